//! The listeners, each from two variables: `HOST` and `PORT` for HTTP, `GRPC_HOST` and
//! `GRPC_PORT` for gRPC. Where one of a pair is set, the other is the reference's default (all
//! interfaces; port 8080 or 8081).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::{Env, Var};
use crate::cli::ServeArgs;

pub(super) fn apply(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if !given("http_addr")
        && let Some(addr) = address(var, "HOST", "PORT", 8080)?
    {
        args.http_addr = addr;
    }
    if !given("grpc_addr")
        && let Some(addr) = address(var, "GRPC_HOST", "GRPC_PORT", 8081)?
    {
        args.grpc_addr = addr;
    }
    Ok(())
}

/// A `HOST`/`PORT`-style pair; `None` when neither is set.
fn address(
    var: Var<'_>,
    host_name: &str,
    port_name: &str,
    default_port: u16,
) -> Result<Option<SocketAddr>, String> {
    let (host, port) = (var(host_name), var(port_name));
    if host.is_none() && port.is_none() {
        return Ok(None);
    }
    socket_addr(host.as_deref(), port.as_deref(), default_port)
        .map(Some)
        .map_err(|wrong| match wrong {
            NotAddress::Host(text) => format!("{host_name}={text:?} is not an IP address"),
            NotAddress::Port(text) => format!("{port_name}={text:?} is not a port number"),
        })
}

/// The half of a host and port that is not one.
pub(super) enum NotAddress<'a> {
    Host(&'a str),
    Port(&'a str),
}

/// A host (an IP address, bracketed or not, or `localhost`; all interfaces when absent) and a
/// port (`default_port` when absent).
pub(super) fn socket_addr<'a>(
    host: Option<&'a str>,
    port: Option<&'a str>,
    default_port: u16,
) -> Result<SocketAddr, NotAddress<'a>> {
    let ip = match host {
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Some("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some(text) => text
            .trim_matches(|c| c == '[' || c == ']')
            .parse()
            .map_err(|_| NotAddress::Host(text))?,
    };
    let port = match port {
        None => default_port,
        Some(text) => text.parse().map_err(|_| NotAddress::Port(text))?,
    };
    Ok(SocketAddr::new(ip, port))
}

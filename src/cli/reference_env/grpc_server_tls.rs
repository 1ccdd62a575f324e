//! TLS on the gRPC port. `GRPC_SERVER_USE_TLS=true` needs `GRPC_SERVER_TLS_CERT` and
//! `GRPC_SERVER_TLS_KEY`; without it the port is plaintext and each TLS variable set is named in
//! a note. Client certificates are required with a client CA (either name, `table.rs`), and
//! `GRPC_CLIENT_TLS_SAN` needs one.

use super::Env;
use super::table::{self, boolean};
use crate::cli::ServeArgs;

/// The variables that mean nothing without `GRPC_SERVER_USE_TLS=true`.
const TLS_VARIABLES: [&str; 5] = [
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_SERVER_TLS_CA_CERT",
    "GRPC_CLIENT_TLS_SAN",
];

pub(super) fn apply(
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let Env { var, given, .. } = env;
    if boolean(var, "GRPC_SERVER_USE_TLS")? != Some(true) {
        for name in TLS_VARIABLES.iter().filter(|n| var(n).is_some()) {
            notes.push(format!(
                "{name} is set but GRPC_SERVER_USE_TLS is not: the gRPC port is plaintext"
            ));
        }
        return Ok(());
    }
    if var("GRPC_SERVER_TLS_CERT").is_none() || var("GRPC_SERVER_TLS_KEY").is_none() {
        return Err(
            "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY".into(),
        );
    }
    table::apply(table::GRPC_SERVER_TLS, args, env, notes)?;
    if let Some(san) = var("GRPC_CLIENT_TLS_SAN")
        && !given("grpc_tls_client_san")
    {
        if args.grpc_tls_client_ca.is_none() {
            return Err(
                "GRPC_CLIENT_TLS_SAN needs GRPC_CLIENT_TLS_CACERT (client certificates)".into(),
            );
        }
        args.grpc_tls_client_san = Some(san);
    }
    Ok(())
}

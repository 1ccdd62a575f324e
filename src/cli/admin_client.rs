//! `slidegate admin inspect|reset`: the admin API's command-line client. It sends the request
//! the flags describe to a running server's `--admin-addr` and prints the answer as a table.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use http_body_util::BodyExt as _;
use serde_json::{Value, json};

#[derive(Debug, clap::Subcommand)]
pub enum AdminAction {
    /// How the descriptors stand: each window's use, limit and reset, the ban, the log's size.
    /// Records nothing.
    Inspect(AdminArgs),
    /// Forget the descriptors' windows and bans, as if they had never been seen.
    Reset(AdminArgs),
}

#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    /// The server's --admin-addr.
    #[arg(long, env = "SLIDEGATE_ADMIN_ADDR")]
    addr: SocketAddr,
    /// A file whose first token line (`NAME TOKEN` or `TOKEN`) is sent as the bearer token:
    /// the server's own --admin-token-file will do.
    #[arg(long, env = "SLIDEGATE_ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Connect over TLS, trusting these PEM CAs for the server's certificate.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate chain, for a server that asks for one (mutual TLS).
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The name the server's certificate must carry (default: the IP of --addr).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// The rate-limit domain.
    #[arg(long)]
    domain: String,
    /// One descriptor, `key=value[,key=value...]` in the order Envoy sends its entries; give
    /// the flag once per descriptor.
    #[arg(long = "descriptor", required = true, value_parser = descriptor_arg)]
    descriptors: Vec<Vec<(String, String)>>,
}

fn descriptor_arg(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
            _ => Err(format!(
                "'{pair}' is not key=value (a descriptor is key=value[,key=value...])"
            )),
        })
        .collect()
}

pub fn run(action: &AdminAction) -> ExitCode {
    let (path, args) = match action {
        AdminAction::Inspect(args) => ("/admin/v1/inspect", args),
        AdminAction::Reset(args) => ("/admin/v1/reset", args),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(call(path, args)) {
        Ok(answer) => {
            match action {
                AdminAction::Inspect(_) => print!("{}", inspect_table(args, &answer)),
                AdminAction::Reset(_) => print!("{}", reset_table(args, &answer)),
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The first token of the file, as the server reads its token file.
fn token(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            line.split_once(char::is_whitespace)
                .map_or(line, |(_, token)| token.trim())
                .to_string()
        })
        .ok_or_else(|| {
            format!(
                "--token-file {}: no token in the file (one per line, `NAME TOKEN` or `TOKEN`)",
                path.display()
            )
        })
}

async fn call(path: &str, args: &AdminArgs) -> Result<Value, String> {
    let token = args.token_file.as_deref().map(token).transpose()?;
    let descriptors: Vec<Value> = args
        .descriptors
        .iter()
        .map(|entries| {
            let entries: Vec<Value> = entries
                .iter()
                .map(|(key, value)| json!({ "key": key, "value": value }))
                .collect();
            json!({ "entries": entries })
        })
        .collect();
    let body = json!({ "domain": args.domain, "descriptors": descriptors }).to_string();
    let stream = tokio::net::TcpStream::connect(args.addr)
        .await
        .map_err(|e| format!("cannot connect to {} (--addr): {e}", args.addr))?;
    match &args.tls_ca {
        None => exchange(path, args, token, body, stream).await,
        Some(_) => {
            let tls = tls_connect(args, stream).await?;
            exchange(path, args, token, body, tls).await
        }
    }
}

/// The TLS handshake with the server, with the client certificate where given.
async fn tls_connect(
    args: &AdminArgs,
    stream: tokio::net::TcpStream,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let files = slidegate::tls::TlsFiles {
        ca: args.tls_ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
        skip_hostname_verification: false,
    };
    let config = slidegate::tls::client_config(&files).map_err(|e| e.to_string())?;
    let name = args
        .tls_server_name
        .clone()
        .unwrap_or_else(|| args.addr.ip().to_string());
    let name = rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|e| format!("--tls-server-name {name}: {e}"))?;
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, stream)
        .await
        .map_err(|e| format!("TLS to {}: {e}", args.addr))
}

/// One HTTP/1.1 request on `stream`, and its answer read as JSON.
async fn exchange<S>(
    path: &str,
    args: &AdminArgs,
    token: Option<String>,
    body: String,
    stream: S,
) -> Result<Value, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("{}: {e}", args.addr))?;
    tokio::spawn(connection);
    let mut request = hyper::Request::post(path)
        .header(hyper::header::HOST, args.addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(token) = token {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("{}: {e}", args.addr))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{}: {e}", args.addr))?
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    match status.as_u16() {
        200 => serde_json::from_slice(&body)
            .map_err(|e| format!("the server answered JSON this client cannot read: {e}")),
        401 => Err(format!(
            "{} refused the token (401): check --token-file against the server's --admin-token-file",
            args.addr
        )),
        _ => Err(format!("{} answered {status}: {}", args.addr, text.trim())),
    }
}

fn descriptor_text(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Rows of cells, padded to their columns.
fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn answered(answer: &Value) -> &[Value] {
    answer
        .get("descriptors")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn inspect_table(args: &AdminArgs, answer: &Value) -> String {
    let mut rows = vec![
        [
            "DESCRIPTOR",
            "RULE",
            "WINDOW",
            "USED",
            "LIMIT",
            "REMAINING",
            "RESET",
            "BAN",
            "ENTRIES",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for (entries, found) in args.descriptors.iter().zip(answered(answer)) {
        let head = vec![descriptor_text(entries), text(&found["rule"])];
        let tail = [text(&found["ban"]["remaining"]), text(&found["entries"])];
        let windows = found["windows"].as_array().map_or(&[][..], Vec::as_slice);
        if windows.is_empty() {
            let mut row = head.clone();
            row.extend(["-", "-", "-", "-", "-"].map(String::from));
            row.extend(tail.iter().cloned());
            rows.push(row);
        }
        for (n, w) in windows.iter().enumerate() {
            let mut row = if n == 0 {
                head.clone()
            } else {
                vec![String::new(), String::new()]
            };
            for field in ["window", "used", "limit", "remaining", "reset"] {
                row.push(text(&w[field]));
            }
            row.extend(tail.iter().cloned());
            rows.push(row);
        }
    }
    table(&rows)
}

fn reset_table(args: &AdminArgs, answer: &Value) -> String {
    let mut rows = vec![["DESCRIPTOR", "RULE", "CLEARED"].map(String::from).to_vec()];
    for (entries, found) in args.descriptors.iter().zip(answered(answer)) {
        rows.push(vec![
            descriptor_text(entries),
            text(&found["rule"]),
            text(&found["cleared"]),
        ]);
    }
    table(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_read_as_pairs_and_bad_ones_say_the_form() {
        assert_eq!(
            descriptor_arg("user=alice,path=/login").expect("two pairs"),
            vec![
                ("user".to_string(), "alice".to_string()),
                ("path".to_string(), "/login".to_string())
            ]
        );
        let error = descriptor_arg("user").expect_err("no value");
        assert!(error.contains("key=value"), "{error}");
    }
}

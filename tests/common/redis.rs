//! Real `redis-server` processes on free loopback ports: standalone and a 3-master cluster.
//! A missing `redis-server` fails the test loudly. Every process also gets a watchdog that
//! kills it when the test binary exits, so shared instances never outlive the run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct RedisProcess {
    pub port: u16,
    child: Child,
    dir: PathBuf,
    extra: Vec<String>,
}

pub struct RedisCluster {
    pub nodes: Vec<RedisProcess>,
}

fn scratch_dir(port: u16) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("slidegate-redis-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create redis scratch dir");
    dir
}

/// A port whose cluster bus port (+10000) is free too. A port is handed out once per test
/// process: a server stopped to be restarted on its port (a Redis restart, a management
/// server's) must not find another test's server there meanwhile. Both sit below the kernel's
/// range for outgoing connections' source ports: a port probed free there can be taken by any
/// client's connection before the server binds it (a sentinel test once lost its metrics port
/// to one).
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let (low, span) = port_range();
    let seed = std::process::id() as u64 * 7919 + NEXT.fetch_add(1, Ordering::SeqCst) * 104_729;
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    for attempt in 0..2000u64 {
        // Below `span`, which fits a port number.
        let port = low + u16::try_from((seed + attempt * 7_877) % span).unwrap_or(0);
        let taken = |p: u16| {
            given
                .iter()
                .any(|g| *g == p || *g + 10_000 == p || *g == p + 10_000)
        };
        if taken(port) {
            continue;
        }
        let a = TcpListener::bind(("127.0.0.1", port));
        let b = TcpListener::bind(("127.0.0.1", port + 10_000));
        if a.is_ok() && b.is_ok() {
            given.push(port);
            return port;
        }
    }
    panic!("no free port pair for redis-server");
}

/// Where [`free_port`] picks: from 10000 up to where the bus port (+10000) would reach the
/// kernel's ephemeral range (`ip_local_port_range`, 32768 by default); the old 20000..45000
/// where that range starts too low to leave room.
fn port_range() -> (u16, u64) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32_768);
    let top = ephemeral_low.saturating_sub(10_000);
    if top >= 12_000 {
        (10_000, top - 10_000)
    } else {
        (20_000, 25_000)
    }
}

fn spawn(port: u16, dir: &PathBuf, extra: &[String]) -> Child {
    let mut command = Command::new("redis-server");
    command
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra);
    spawn_watched(command)
}

/// Starts a Redis process that dies with this test binary.
fn spawn_watched(mut command: Command) -> Child {
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start redis-server ({e}): install Debian's redis-server (tests/run.sh does)"
            )
        });
    // Watchdog: when this test binary is gone, the server goes too.
    let script = format!(
        "while kill -0 {parent} 2>/dev/null; do sleep 1; done; kill -9 {child} 2>/dev/null",
        parent = std::process::id(),
        child = child.id()
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    child
}

/// Sends one inline command and returns the raw reply.
pub fn command(port: u16, line: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("{line}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 65536];
    let n = stream.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// A reply read off the wire, for [`fcall_lines`].
enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Resp>),
}

fn read_resp(reader: &mut impl std::io::BufRead) -> std::io::Result<Resp> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let line = line.trim_end_matches(['\r', '\n']);
    let bad = || std::io::Error::other(format!("not a RESP reply: {line:?}"));
    let (kind, rest) = line.split_at_checked(1).ok_or_else(bad)?;
    let number = || rest.parse::<i64>().map_err(|_| bad());
    Ok(match kind {
        "+" => Resp::Simple(rest.to_string()),
        "-" => Resp::Error(rest.to_string()),
        ":" => Resp::Int(number()?),
        "$" => match usize::try_from(number()?) {
            Ok(len) => {
                let mut bytes = vec![0u8; len + 2];
                reader.read_exact(&mut bytes)?;
                bytes.truncate(len);
                Resp::Bulk(Some(bytes))
            }
            Err(_) => Resp::Bulk(None),
        },
        "*" => {
            let n = number()?;
            let mut all = Vec::new();
            for _ in 0..n {
                all.push(read_resp(reader)?);
            }
            Resp::Array(all)
        }
        _ => return Err(bad()),
    })
}

/// One command with these arguments, its reply as the lines `redis-cli` prints without a
/// terminal (an error as its text, an array one value a line), except that a reply of
/// slidegate's script (one packed MessagePack array, as a bulk string) is read and printed one
/// value a line as well, the way its RESP array was.
pub fn fcall_lines(port: u16, args: &[&str]) -> Vec<String> {
    let mut request = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        request.extend(format!("${}\r\n", arg.len()).as_bytes());
        request.extend(arg.as_bytes());
        request.extend(b"\r\n");
    }
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    (&stream).write_all(&request).expect("send to redis");
    let reply = read_resp(&mut std::io::BufReader::new(&stream)).expect("read a reply");
    let mut lines = Vec::new();
    print_resp(reply, &mut lines);
    lines
}

fn print_resp(reply: Resp, lines: &mut Vec<String>) {
    use slidegate::store::redis::packed::{self, Item};
    match reply {
        Resp::Simple(text) | Resp::Error(text) => lines.push(text),
        Resp::Int(n) => lines.push(n.to_string()),
        Resp::Bulk(None) => lines.push(String::new()),
        // A bulk string that is no packed array (not of the script) as its text.
        Resp::Bulk(Some(bytes)) => match packed::array(&bytes) {
            Ok(_) => {
                let items = packed::read_all(&bytes).expect("a packed reply");
                lines.extend(items.into_iter().map(|item| match item {
                    Item::Int(n) => n.to_string(),
                    Item::Text(text) => String::from_utf8_lossy(text).into_owned(),
                }));
            }
            Err(_) => lines.push(String::from_utf8_lossy(&bytes).into_owned()),
        },
        Resp::Array(all) => {
            for value in all {
                print_resp(value, lines);
            }
        }
    }
}

/// Waits until `check` holds, or panics at the deadline.
pub fn wait_until(what: &str, deadline: Duration, mut check: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !check() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

impl RedisProcess {
    pub fn start(extra: &[&str]) -> RedisProcess {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        RedisProcess::start_with(
            |_| extra.clone(),
            |port| command(port, "PING").is_ok_and(|r| r.starts_with("+PONG")),
        )
    }

    /// Starts with arguments that may depend on the chosen port (later arguments override
    /// earlier ones, so `--port 0 --tls-port <port>` serves TLS only), ready when `ready` holds.
    pub fn start_with(
        extra: impl Fn(u16) -> Vec<String>,
        ready: impl Fn(u16) -> bool,
    ) -> RedisProcess {
        let port = free_port();
        let dir = scratch_dir(port);
        let extra = extra(port);
        let child = spawn(port, &dir, &extra);
        let process = RedisProcess {
            port,
            child,
            dir,
            extra,
        };
        wait_until(
            &format!("redis-server on {port}"),
            Duration::from_secs(10),
            || ready(port),
        );
        process
    }

    /// Starts a plain server on `port` (a port slidegate was pointed at before Redis existed).
    pub fn start_on(port: u16) -> RedisProcess {
        let dir = scratch_dir(port);
        let child = spawn(port, &dir, &[]);
        let process = RedisProcess {
            port,
            child,
            dir,
            extra: Vec::new(),
        };
        process.wait_ready();
        process
    }

    fn wait_ready(&self) {
        let port = self.port;
        wait_until(
            &format!("redis-server on {port}"),
            Duration::from_secs(10),
            || command(port, "PING").is_ok_and(|r| r.starts_with("+PONG")),
        );
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port (after `stop`).
    pub fn restart(&mut self) {
        self.stop();
        self.child = spawn(self.port, &self.dir, &self.extra);
        self.wait_ready();
    }

    /// Freezes the process (`SIGSTOP`): connections stay open and nothing answers, as with a
    /// node that hangs or a network that drops packets; `thaw` resumes it.
    pub fn freeze(&self) {
        signal(self.child.id(), "STOP");
    }

    pub fn thaw(&self) {
        signal(self.child.id(), "CONT");
    }

    pub fn cmd(&self, line: &str) -> String {
        command(self.port, line).unwrap_or_else(|e| panic!("redis {}: {line}: {e}", self.port))
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends the signal `name` (`STOP`, `HUP`, ...) to the process `pid`.
pub fn signal(pid: u32, name: &str) {
    let sent = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -{name} {pid}");
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(&[])
    }

    /// A cluster whose nodes also take `extra` arguments.
    pub fn start_with(extra: &[&str]) -> RedisCluster {
        let nodes: Vec<RedisProcess> = (0..3)
            .map(|_| {
                let port = free_port();
                let conf = format!("nodes-{port}.conf");
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "5000",
                ];
                args.extend_from_slice(extra);
                RedisProcess::start(&args)
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-cli ({e}): install Debian's redis-server (tests/run.sh does)"
                )
            });
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for node in &nodes {
            let port = node.port;
            wait_until(
                &format!("cluster state ok on {port}"),
                Duration::from_secs(20),
                || command(port, "CLUSTER INFO").is_ok_and(|r| r.contains("cluster_state:ok")),
            );
        }
        RedisCluster { nodes }
    }

    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis-cluster://{}", hosts.join(","))
    }
}

/// One standalone server shared by the tests of a binary (tests use unique domains).
pub fn shared_standalone() -> &'static RedisProcess {
    static SHARED: OnceLock<RedisProcess> = OnceLock::new();
    SHARED.get_or_init(|| RedisProcess::start(&[]))
}

/// One 3-master cluster shared by the tests of a binary.
pub fn shared_cluster() -> &'static RedisCluster {
    static SHARED: OnceLock<RedisCluster> = OnceLock::new();
    SHARED.get_or_init(RedisCluster::start)
}

/// A real Redis Sentinel (`redis-server --sentinel`, the same code as Debian's `redis-sentinel`)
/// watching `master` under the name `mymaster`.
pub struct RedisSentinel {
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl RedisSentinel {
    /// `master_password`: what the sentinel authenticates to the master with (the sentinel
    /// itself takes no password, as in most deployments).
    pub fn start(master: &RedisProcess, master_password: Option<&str>) -> RedisSentinel {
        let port = free_port();
        let dir = scratch_dir(port);
        let conf = dir.join("sentinel.conf");
        let mut text = format!(
            "port {port}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {} 1\n",
            master.port
        );
        if let Some(password) = master_password {
            text.push_str(&format!("sentinel auth-pass mymaster {password}\n"));
        }
        std::fs::write(&conf, text).expect("write sentinel.conf");
        let mut command = Command::new("redis-server");
        command.arg(&conf).arg("--sentinel").arg("--dir").arg(&dir);
        let child = spawn_watched(command);
        wait_until(
            &format!("redis sentinel on {port}"),
            Duration::from_secs(10),
            || {
                command_reply(port, "SENTINEL get-master-addr-by-name mymaster")
                    .is_some_and(|r| r.contains(&master.port.to_string()))
            },
        );
        RedisSentinel { port, child, dir }
    }
}

fn command_reply(port: u16, line: &str) -> Option<String> {
    command(port, line).ok()
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A test CA (`ca.crt`, `ca.key`) and, for each `(name, subjectAltName)`, `<name>.crt` and
/// `<name>.key` signed by it, made with openssl in `dir`.
pub fn make_certs(dir: &std::path::Path, certs: &[(&str, &str)]) {
    openssl(
        dir,
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=slidegate-test-ca 2>/dev/null",
    );
    for (name, san) in certs {
        sign_cert(dir, name, san);
    }
}

/// A new key and certificate `<name>.key`/`<name>.crt` in `dir`, signed by its `ca.crt`.
pub fn sign_cert(dir: &std::path::Path, name: &str, san: &str) {
    openssl(
        dir,
        &format!(
            "openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj /CN={name} 2>/dev/null && printf 'subjectAltName={san}\\n' > {name}.cnf && openssl x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out {name}.crt -days 2 -extfile {name}.cnf 2>/dev/null"
        ),
    );
}

fn openssl(dir: &std::path::Path, script: &str) {
    let out = Command::new("sh")
        .args(["-c", script])
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl RedisProcess {
    /// A Redis serving TLS only, with `server.crt`/`server.key` and `ca.crt` from `dir` (see
    /// [`make_certs`]); with `client` (a certificate name in `dir`) it requires client
    /// certificates signed by the CA. `extra` follows. Ready once a TLS connection gets an
    /// answer to PING (`NOAUTH` counts: TLS is up, the password is the test's business).
    pub fn start_tls(dir: &std::path::Path, client: Option<&str>, extra: &[&str]) -> RedisProcess {
        let file = |name: &str| dir.join(name).display().to_string();
        let (ca, cert, key) = (file("ca.crt"), file("server.crt"), file("server.key"));
        let client_files = client.map(|c| (file(&format!("{c}.crt")), file(&format!("{c}.key"))));
        RedisProcess::start_with(
            |port| {
                let mut args: Vec<String> = [
                    "--port",
                    "0",
                    "--tls-port",
                    &port.to_string(),
                    "--tls-cert-file",
                    &cert,
                    "--tls-key-file",
                    &key,
                    "--tls-ca-cert-file",
                    &ca,
                    "--tls-auth-clients",
                    if client.is_some() { "yes" } else { "no" },
                ]
                .map(String::from)
                .to_vec();
                args.extend(extra.iter().map(|a| a.to_string()));
                args
            },
            |port| {
                let mut cli = Command::new("redis-cli");
                cli.args(["--tls", "--insecure", "--cacert", &ca]);
                if let Some((cert, key)) = &client_files {
                    cli.args(["--cert", cert, "--key", key]);
                }
                cli.args(["-h", "127.0.0.1", "-p", &port.to_string(), "PING"])
                    .output()
                    .is_ok_and(|o| {
                        let reply = String::from_utf8_lossy(&o.stdout);
                        reply.contains("PONG") || reply.contains("NOAUTH")
                    })
            },
        )
    }
}

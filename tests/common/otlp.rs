//! An OTLP trace receiver (`tests/clients/otlp_receiver.py`, on PyPI opentelemetry-proto's
//! service definitions) run beside the test, and the spans it received.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::KillOnDrop;
use super::redis::free_port;

/// One span as the receiver printed it.
#[derive(Clone, Debug)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    pub service: String,
    pub protocol: String,
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

impl Span {
    pub fn attribute(&self, key: &str) -> Option<String> {
        self.attributes.get(key).map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

pub struct Receiver {
    pub grpc_port: u16,
    pub http_port: u16,
    spans: Arc<Mutex<Vec<Span>>>,
    _process: KillOnDrop,
}

impl Receiver {
    /// A receiver answering each export `delay` late; waits until it listens.
    pub fn start(delay: Duration) -> Receiver {
        let (grpc_port, http_port) = (free_port(), free_port());
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/otlp_receiver.py");
        let mut child = Command::new(super::venv_python())
            .arg(script)
            .args([grpc_port.to_string(), http_port.to_string()])
            .args(["--delay", &delay.as_secs_f64().to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the OTLP receiver");
        let stdout = child.stdout.take().expect("receiver's output");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let (ready, is_ready) = std::sync::mpsc::channel();
        let into = spans.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if line == "ready" {
                    let _ = ready.send(());
                    continue;
                }
                let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                let text = |k: &str| value[k].as_str().unwrap_or_default().to_string();
                let span = Span {
                    trace_id: text("trace_id"),
                    span_id: text("span_id"),
                    parent_span_id: text("parent_span_id"),
                    name: text("name"),
                    service: text("service"),
                    protocol: text("protocol"),
                    attributes: value["attributes"].as_object().cloned().unwrap_or_default(),
                };
                into.lock().unwrap().push(span);
            }
        });
        is_ready
            .recv_timeout(Duration::from_secs(30))
            .expect("the OTLP receiver listens");
        Receiver {
            grpc_port,
            http_port,
            spans,
            _process: KillOnDrop(child),
        }
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (up to `deadline`) until a span matches `found`, and returns it.
    pub fn wait_for(&self, what: &str, deadline: Duration, found: impl Fn(&Span) -> bool) -> Span {
        let end = Instant::now() + deadline;
        loop {
            if let Some(span) = self.spans().into_iter().find(|s| found(s)) {
                return span;
            }
            assert!(
                Instant::now() < end,
                "no span {what} within {deadline:?}; received: {:#?}",
                self.spans()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

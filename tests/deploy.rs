//! The files users copy from `deploy/`, checked offline by the field's own tools (from PyPI, in
//! `.venv`: kubernetes-validate, hadolint) and for the fields the README promises.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::KillOnDrop;
use common::redis::free_port;
use serde_json::Value;

const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

fn tool(name: &str) -> PathBuf {
    let path = PathBuf::from(MANIFEST).join(".venv/bin").join(name);
    assert!(
        path.exists(),
        "no {} : run tests/run.sh, which installs it into .venv from PyPI",
        path.display()
    );
    path
}

fn documents(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(format!("{MANIFEST}/{file}"))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{file} does not parse: {e}"))
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {docs:?}"))
}

fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The slidegate container's promises: image, both ports or the HTTP one, probes on the HTTP
/// endpoints, limits mounted from the ConfigMap as a directory, resource requests.
fn check_slidegate_container(deployment: &Value, grpc_port: bool) {
    let c = container(deployment, "slidegate");
    assert!(
        c["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("slidegate:")),
        "{c}"
    );
    let ports: Vec<i64> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .filter_map(|p| p["containerPort"].as_i64())
        .collect();
    assert!(ports.contains(&8080), "{ports:?}");
    if grpc_port {
        assert!(ports.contains(&8081), "{ports:?}");
    }
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(
        c["resources"]["requests"]["cpu"].is_string()
            && c["resources"]["requests"]["memory"].is_string()
    );
    let mount = c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"] == "/etc/slidegate")
        .expect("config mount");
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never sees ConfigMap updates"
    );
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    let volume = volumes
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("volume for the mount");
    assert_eq!(volume["configMap"]["name"], "slidegate-limits");
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        args.windows(2).any(|w| w == ["--config", "/etc/slidegate"]),
        "{args:?}"
    );
}

#[test]
fn kubernetes_manifests_validate_against_the_schemas() {
    let files: Vec<String> = [
        "limits-configmap.yaml",
        "redis-secret.yaml",
        "redis.yaml",
        "shared.yaml",
        "sidecar.yaml",
    ]
    .iter()
    .map(|f| format!("{MANIFEST}/deploy/kubernetes/{f}"))
    .collect();
    let out = Command::new(tool("kubernetes-validate"))
        .args(["--strict", "--quiet"])
        .args(&files)
        .output()
        .expect("run kubernetes-validate");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn shared_service_carries_what_the_readme_promises() {
    let docs = documents("deploy/kubernetes/shared.yaml");
    let deployment = find(&docs, "Deployment");
    check_slidegate_container(deployment, true);
    let env = container(deployment, "slidegate")["env"]
        .as_array()
        .expect("env");
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .clone()
    };
    // The password from the Secret, into the URL by Kubernetes' $(VAR) expansion (a variable
    // defined before the one that names it).
    assert_eq!(
        var("REDIS_PASSWORD")["valueFrom"]["secretKeyRef"],
        serde_json::json!({"name": "slidegate-redis", "key": "password"})
    );
    let url = var("SLIDEGATE_REDIS_URL")["value"]
        .as_str()
        .expect("a URL")
        .to_string();
    let service = find(&docs, "Service");
    let ports: Vec<i64> = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(ports, vec![8081, 8080]);
    assert_eq!(
        find(&docs, "PodDisruptionBudget")["spec"]["minAvailable"],
        1
    );
    let spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        .as_array()
        .expect("topology spread");
    let keys: Vec<&str> = spread
        .iter()
        .filter_map(|c| c["topologyKey"].as_str())
        .collect();
    assert_eq!(
        keys,
        ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    );
    // The NetworkPolicy lets in both ports and out to Redis and DNS.
    let policy = find(&docs, "NetworkPolicy");
    let ingress: Vec<i64> = policy["spec"]["ingress"]
        .as_array()
        .expect("ingress")
        .iter()
        .flat_map(|r| r["ports"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(ingress, [8081, 8080]);
    let egress = policy["spec"]["egress"].to_string();
    assert!(egress.contains("6379") && egress.contains("53"), "{egress}");

    let secret = find(&documents("deploy/kubernetes/redis-secret.yaml"), "Secret").clone();
    assert!(secret["stringData"]["password"].is_string());
    // The Redis the URL names is one redis.yaml deploys: its Service, on its port, with the
    // Secret's password required.
    let redis = documents("deploy/kubernetes/redis.yaml");
    let redis_service = find(&redis, "Service");
    let port = redis_service["spec"]["ports"][0]["port"]
        .as_i64()
        .expect("port");
    let host = format!(
        "redis://:$(REDIS_PASSWORD)@{}.ratelimit.svc.cluster.local:{port}",
        redis_service["metadata"]["name"].as_str().expect("name")
    );
    assert_eq!(url, host);
    let redis_container = &find(&redis, "StatefulSet")["spec"]["template"]["spec"]["containers"][0];
    let args = redis_container["args"].to_string();
    assert!(
        args.contains("noeviction")
            && args.contains("appendonly")
            && args.contains(r#""--requirepass","$(REDIS_PASSWORD)""#),
        "{args}"
    );
    assert!(
        redis_container["env"].to_string().contains("REDISCLI_AUTH"),
        "the readiness probe's redis-cli authenticates"
    );
    let redis_policy = find(&redis, "NetworkPolicy");
    assert_eq!(
        redis_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "slidegate",
        "only slidegate reaches Redis"
    );
}

/// Every pod of deploy/kubernetes meets Pod Security "restricted"
/// (<https://kubernetes.io/docs/concepts/security/pod-security-standards/>): non-root, no
/// privilege escalation, every capability dropped, the runtime's default seccomp profile, no
/// host namespaces or host paths.
#[test]
fn every_pod_meets_restricted_pod_security() {
    let mut pods = 0;
    for file in ["redis.yaml", "shared.yaml", "sidecar.yaml"] {
        for doc in documents(&format!("deploy/kubernetes/{file}")) {
            let spec = &doc["spec"]["template"]["spec"];
            if spec.is_null() {
                continue;
            }
            pods += 1;
            let pod = &spec["securityContext"];
            for host in ["hostNetwork", "hostPID", "hostIPC"] {
                assert_ne!(spec[host], true, "{file}: {host}");
            }
            assert!(
                spec["volumes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .all(|v| v["hostPath"].is_null()),
                "{file}: a hostPath volume"
            );
            for c in spec["containers"].as_array().expect("containers") {
                let name = c["name"].as_str().unwrap_or("?");
                let own = &c["securityContext"];
                let either = |key: &str| {
                    if own[key].is_null() {
                        pod[key].clone()
                    } else {
                        own[key].clone()
                    }
                };
                assert_eq!(either("runAsNonRoot"), true, "{file}/{name}: runAsNonRoot");
                assert_ne!(either("runAsUser"), 0, "{file}/{name}: runAsUser 0");
                assert_eq!(
                    either("seccompProfile")["type"],
                    "RuntimeDefault",
                    "{file}/{name}: seccompProfile"
                );
                assert_eq!(
                    own["allowPrivilegeEscalation"], false,
                    "{file}/{name}: allowPrivilegeEscalation"
                );
                assert_ne!(own["privileged"], true, "{file}/{name}: privileged");
                assert_eq!(
                    own["capabilities"]["drop"],
                    serde_json::json!(["ALL"]),
                    "{file}/{name}: capabilities.drop"
                );
                assert!(
                    own["capabilities"]["add"].is_null(),
                    "{file}/{name}: capabilities.add"
                );
            }
        }
    }
    assert_eq!(pods, 3, "redis, shared and sidecar");
}

#[test]
fn sidecar_carries_what_the_readme_promises() {
    let docs = documents("deploy/kubernetes/sidecar.yaml");
    let deployment = find(&docs, "Deployment");
    check_slidegate_container(deployment, false);
    let args = container(deployment, "slidegate")["args"].to_string();
    assert!(
        args.contains("127.0.0.1:8081"),
        "Envoy reaches the sidecar on loopback: {args}"
    );
    assert!(
        args.contains(r#""--worker-threads","1""#),
        "a sidecar on shared cores runs one worker: {args}"
    );
    assert!(
        container(deployment, "envoy")["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("envoyproxy/envoy:"))
    );
}

#[test]
fn limits_configmap_is_a_valid_config() {
    let docs = documents("deploy/kubernetes/limits-configmap.yaml");
    let text = find(&docs, "ConfigMap")["data"]["limits.yaml"]
        .as_str()
        .expect("limits.yaml")
        .to_string();
    let limits = slidegate::config::compile_sources(&[("limits.yaml".into(), text)])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(limits.domain("edge").is_some());
    slidegate::config::load_path(std::path::Path::new(&format!(
        "{MANIFEST}/deploy/envoy/limits.yaml"
    )))
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn istio_envoyfilter_points_at_slidegate() {
    let docs = documents("deploy/istio/envoyfilter.yaml");
    assert_eq!(docs.len(), 2);
    let filter = &docs[0]["spec"]["configPatches"][0]["patch"]["value"];
    assert_eq!(filter["name"], "envoy.filters.http.ratelimit");
    let config = &filter["typed_config"];
    assert_eq!(config["domain"], "edge");
    assert_eq!(
        config["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"],
        "outbound|8081||slidegate.ratelimit.svc.cluster.local"
    );
    assert_eq!(config["rate_limit_service"]["transport_api_version"], "V3");
    assert_eq!(
        config["rate_limit_service"]["grpc_service"]["envoy_grpc"]["authority"],
        "slidegate.ratelimit.svc.cluster.local",
        "the authority Istio's global rate-limit task sets"
    );
    let actions = &docs[1]["spec"]["configPatches"][0]["patch"]["value"]["rate_limits"];
    assert_eq!(
        actions[0]["actions"][0]["request_headers"]["descriptor_key"],
        "user"
    );
}

#[test]
fn dockerfile_passes_hadolint_and_builds_a_non_root_image() {
    let out = Command::new(tool("hadolint"))
        .arg(format!("{MANIFEST}/deploy/Dockerfile"))
        .output()
        .expect("run hadolint");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text =
        std::fs::read_to_string(format!("{MANIFEST}/deploy/Dockerfile")).expect("Dockerfile");
    assert_eq!(
        text.matches("\nFROM ").count() + usize::from(text.starts_with("FROM ")),
        2,
        "multi-stage build"
    );
    assert!(text.contains("USER 65532"), "runs as non-root");
    assert!(text.contains("EXPOSE 8080 8081"));
}

/// A Dockerfile's instructions, continuation lines joined and comments dropped: (instruction,
/// arguments).
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => pending.push_str(part),
            None => {
                pending.push_str(line);
                let (op, args) = pending.split_once(' ').unwrap_or((&pending, ""));
                out.push((op.to_ascii_uppercase(), args.trim().to_string()));
                pending.clear();
            }
        }
    }
    out
}

/// Whether `.dockerignore` lets the top-level entry `name` into the build context. It holds
/// only the forms this reader knows (`*`, then `!name` exceptions), which the test checks.
fn in_context(ignore: &str, name: &str) -> bool {
    let mut included = true;
    for line in ignore.lines().map(str::trim) {
        match line {
            "" => {}
            _ if line.starts_with('#') => {}
            "*" => included = false,
            _ => {
                let exception = line.strip_prefix('!').unwrap_or_else(|| {
                    panic!(".dockerignore: `{line}` is not a form this test reads (`*` or `!name`)")
                });
                assert!(
                    !exception.contains(['*', '?', '/']),
                    ".dockerignore: `{line}` is not a top-level name"
                );
                if exception == name {
                    included = true;
                }
            }
        }
    }
    included
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}

/// The image's build stage replayed without a container engine: a directory holding exactly
/// what the build stage copies, each path let into the context by `.dockerignore` (a path the
/// Dockerfile copies that is missing or ignored fails here, as it would fail `docker build`),
/// then the stage's build command run there (`cargo check` in place of `cargo build
/// --release`: the same sources, build script and manifest read, without building every
/// dependency again). The runtime stage copies the binary the build stage makes and starts it.
#[test]
fn the_image_build_replays_from_exactly_what_the_dockerfile_copies() {
    let dockerfile =
        std::fs::read_to_string(format!("{MANIFEST}/deploy/Dockerfile")).expect("Dockerfile");
    let ignore =
        std::fs::read_to_string(format!("{MANIFEST}/.dockerignore")).expect(".dockerignore");
    let steps = instructions(&dockerfile);
    let stages: Vec<usize> = (0..steps.len()).filter(|&i| steps[i].0 == "FROM").collect();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let (build, runtime) = (&steps[stages[0]..stages[1]], &steps[stages[1]..]);
    assert!(build[0].1.ends_with(" AS build"), "{:?}", build[0]);

    let scratch = common::temp_dir("docker-replay");
    let mut workdir = PathBuf::from("/");
    let mut args = Vec::new();
    let mut command = None;
    for (op, rest) in build {
        match op.as_str() {
            "FROM" => {}
            "WORKDIR" => workdir = PathBuf::from(rest),
            "ARG" => args.push(
                rest.split_once('=')
                    .map_or((rest.clone(), String::new()), |(k, v)| {
                        (k.to_string(), v.to_string())
                    }),
            ),
            "COPY" => {
                let parts: Vec<&str> = rest.split_whitespace().collect();
                let (sources, dest) = parts.split_at(parts.len() - 1);
                let dest = scratch.0.join(dest[0]);
                for source in sources {
                    assert!(
                        in_context(&ignore, source),
                        "the Dockerfile copies {source}, which .dockerignore leaves out of the context"
                    );
                    let from = PathBuf::from(MANIFEST).join(source);
                    assert!(
                        from.exists(),
                        "the Dockerfile copies {source}, which does not exist"
                    );
                    let to = if sources.len() > 1 || dest.to_string_lossy().ends_with('/') {
                        dest.join(source)
                    } else {
                        dest.clone()
                    };
                    copy_tree(&from, &to);
                }
            }
            "RUN" => command = Some(rest.clone()),
            other => panic!("the build stage has `{other}`, which this replay does not know"),
        }
    }
    let command = command.expect("the build stage runs the build");
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(
        words,
        [
            "cargo",
            "build",
            "--release",
            "--locked",
            "--bin",
            "slidegate"
        ],
        "the replay runs this command"
    );
    let check = Command::new("cargo")
        .args(["check", "--locked", "--bin", "slidegate"])
        .current_dir(&scratch.0)
        .env(
            "CARGO_TARGET_DIR",
            format!("{MANIFEST}/target/dockerfile-replay"),
        )
        .envs(args.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("run cargo");
    assert!(
        check.status.success(),
        "the build stage fails from what the Dockerfile copies:\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert_eq!(workdir, PathBuf::from("/src"));

    // The runtime stage: the binary the build made, at the paths it starts.
    let built = format!("{}/target/release/slidegate", workdir.display());
    let copied: Vec<String> = runtime
        .iter()
        .filter(|(op, _)| op == "COPY")
        .map(|(_, rest)| {
            let parts: Vec<&str> = rest.split_whitespace().collect();
            assert_eq!(parts, ["--from=build", built.as_str(), parts[2]], "{rest}");
            parts[2].to_string()
        })
        .collect();
    assert!(copied.contains(&"/bin/ratelimit".to_string()), "{copied:?}");
    let entrypoint = runtime
        .iter()
        .find(|(op, _)| op == "ENTRYPOINT")
        .map(|(_, rest)| serde_json::from_str::<Vec<String>>(rest).expect("exec form"))
        .expect("an ENTRYPOINT");
    assert!(
        copied.contains(&entrypoint[0]),
        "{entrypoint:?} is not {copied:?}"
    );
}

#[test]
fn dockerignore_reader_knows_its_forms() {
    let ignore = "# comment\n*\n!src\n!Cargo.toml\n";
    assert!(in_context(ignore, "src") && in_context(ignore, "Cargo.toml"));
    assert!(!in_context(ignore, "target") && !in_context(ignore, ".cargo"));
    assert!(in_context("", "anything"));
}

/// An HTTP GET as the kubelet's probe does it: any status from 200 to 399 is a success.
fn probe(port: u16, path: &str) -> Option<u16> {
    let reply = common::redis::command(port, &format!("GET {path} HTTP/1.0\r\n")).ok()?;
    reply.split_whitespace().nth(1)?.parse().ok()
}

fn succeeds(code: Option<u16>) -> bool {
    code.is_some_and(|c| (200..400).contains(&c))
}

/// Runs the slidegate container of `file` as Kubernetes would: its exact `args` and `env`
/// (the Secret's Redis URL pointing at a test Redis, the ConfigMap mounted as a ConfigMap
/// directory), its container ports mapped to free ones, then checks every probe as the kubelet
/// would, and that on SIGTERM readiness fails at once while liveness holds (the drain delay).
fn run_container(file: &str) {
    let docs = documents(file);
    let c = container(find(&docs, "Deployment"), "slidegate").clone();
    let scratch = common::temp_dir("manifest");
    let limits = find(
        &documents("deploy/kubernetes/limits-configmap.yaml"),
        "ConfigMap",
    )["data"]
        .clone();
    let mount = scratch.0.join("limits");
    std::fs::create_dir_all(mount.join("..v1")).expect("mount");
    for (name, text) in limits.as_object().expect("data") {
        std::fs::write(mount.join("..v1").join(name), text.as_str().expect("text")).expect("file");
        std::os::unix::fs::symlink(format!("..data/{name}"), mount.join(name)).expect("link");
    }
    std::os::unix::fs::symlink("..v1", mount.join("..data")).expect("..data");
    // Container port -> a free port here (what the pod's own network namespace gives it).
    let ports: HashMap<i64, u16> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .filter_map(|p| p["containerPort"].as_i64())
        .chain([8080, 8081])
        .map(|p| (p, free_port()))
        .collect();
    let mapped = |text: &str| {
        let mut out = text.replace("/etc/slidegate", &mount.display().to_string());
        for (from, to) in &ports {
            out = out.replace(&format!(":{from}"), &format!(":{to}"));
        }
        out
    };
    let args: Vec<String> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| mapped(a.as_str().expect("arg")))
        .collect();
    let mut command = Command::new(env!("CARGO_BIN_EXE_slidegate"));
    command.env_clear().args(&args);
    // A Redis with the Secret's password required, reached where the manifest's URL points.
    let secret = find(&documents("deploy/kubernetes/redis-secret.yaml"), "Secret").clone();
    let password = secret["stringData"]["password"]
        .as_str()
        .expect("password")
        .to_string();
    let redis = c["env"].to_string().contains("slidegate-redis").then(|| {
        let required = password.clone();
        common::redis::RedisProcess::start_with(
            move |_| vec!["--requirepass".into(), required.clone()],
            |port| {
                common::redis::command(port, "PING")
                    .is_ok_and(|r| r.starts_with("-NOAUTH") || r.starts_with("+PONG"))
            },
        )
    });
    let mut defined: Vec<(String, String)> = Vec::new();
    for var in c["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().expect("name");
        let value = match (&var["value"], &var["valueFrom"]["secretKeyRef"]) {
            (Value::String(v), _) => {
                // Kubernetes' expansion: $(NAME) of a variable defined before this one.
                let mut v = v.clone();
                for (earlier, value) in &defined {
                    v = v.replace(&format!("$({earlier})"), value);
                }
                assert!(
                    !v.contains("$("),
                    "{file}: env {name}: {v} names no earlier variable"
                );
                match &redis {
                    Some(redis) => v.replace(
                        "redis.ratelimit.svc.cluster.local:6379",
                        &format!("127.0.0.1:{}", redis.port),
                    ),
                    None => v,
                }
            }
            (_, key) if key["name"] == "slidegate-redis" => secret["stringData"]
                [key["key"].as_str().expect("key")]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: env {name}: the Secret has no {key}"))
            .to_string(),
            (other, _) => panic!("{file}: env {name} from {other} is not understood"),
        };
        defined.push((name.to_string(), value.clone()));
        command.env(name, value);
    }
    for (flag, var, port) in [
        ("--http-addr", "SLIDEGATE_HTTP_ADDR", 8080),
        ("--grpc-addr", "SLIDEGATE_GRPC_ADDR", 8081),
    ] {
        if !args.iter().any(|a| a == flag) {
            command.env(var, format!("127.0.0.1:{}", ports[&port]));
        }
    }
    let mut child = KillOnDrop(
        command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    let port_of = |probe: &Value| -> u16 {
        let port = &probe["httpGet"]["port"];
        let number = port.as_i64().unwrap_or_else(|| {
            c["ports"]
                .as_array()
                .and_then(|ps| ps.iter().find(|p| p["name"] == *port))
                .and_then(|p| p["containerPort"].as_i64())
                .unwrap_or_else(|| panic!("{file}: no container port named {port}"))
        });
        ports[&number]
    };
    let (live, ready) = (&c["livenessProbe"], &c["readinessProbe"]);
    let path = |probe: &Value| probe["httpGet"]["path"].as_str().expect("path").to_string();
    let end = Instant::now() + Duration::from_secs(20);
    while !succeeds(probe(port_of(ready), &path(ready))) {
        assert!(
            Instant::now() < end,
            "{file}: readiness probe never succeeded"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(
        succeeds(probe(port_of(live), &path(live))),
        "{file}: liveness"
    );

    // SIGTERM, as the kubelet sends it: out of the endpoints at once, still alive and serving.
    let pid = child.0.id().to_string();
    let term = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(term.success());
    let end = Instant::now() + Duration::from_secs(3);
    while succeeds(probe(port_of(ready), &path(ready))) {
        assert!(Instant::now() < end, "{file}: still ready after SIGTERM");
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(
        succeeds(probe(port_of(live), &path(live))),
        "{file}: liveness holds while draining, so the kubelet does not kill it early"
    );
    assert!(
        child.0.try_wait().expect("wait").is_none(),
        "{file}: exited before the drain delay"
    );
}

#[test]
fn sidecar_container_starts_as_its_manifest_says_and_answers_its_probes() {
    run_container("deploy/kubernetes/sidecar.yaml");
}

#[test]
fn shared_container_starts_as_its_manifest_says_and_answers_its_probes() {
    run_container("deploy/kubernetes/shared.yaml");
}

/// deploy/envoy-gateway: Envoy Gateway's Helm values swap the rate-limit image for the one the
/// docs build and set a Redis backend; the BackendTrafficPolicy is the shape the end-to-end test runs through a real
/// Envoy (tests/fixtures/envoy-gateway.yaml: x-user-id sent as `rule-0-match-0`, 3 per hour).
#[test]
fn envoy_gateway_manifests_say_what_the_tests_run() {
    // Envoy Gateway's Helm values: the rate-limit image (the chart's global.images.ratelimit)
    // and the Redis backend, as the chart's values name them.
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(format!("{MANIFEST}/deploy/envoy-gateway/helm-values.yaml"))
            .expect("helm-values.yaml"),
    )
    .expect("the values parse");
    let image = &values["global"]["images"]["ratelimit"]["image"];
    let docs = std::fs::read_to_string(format!("{MANIFEST}/docs/deploy.md")).expect("docs");
    assert!(
        image
            .as_str()
            .is_some_and(|i| i.ends_with("/slidegate:0.1.0") && docs.contains(i)),
        "the image the docs build and push: {image}"
    );
    let backend = &values["config"]["envoyGateway"]["rateLimit"]["backend"];
    assert_eq!(backend["type"], "Redis");
    assert!(backend["redis"]["url"].is_string());

    let policy = find(
        &documents("deploy/envoy-gateway/backend-traffic-policy.yaml"),
        "BackendTrafficPolicy",
    )
    .clone();
    assert_eq!(policy["spec"]["targetRefs"][0]["kind"], "HTTPRoute");
    assert_eq!(policy["spec"]["rateLimit"]["type"], "Global");
    let rule = &policy["spec"]["rateLimit"]["global"]["rules"][0];
    let header = &rule["clientSelectors"][0]["headers"][0];
    assert_eq!(header["name"], "x-user-id");
    assert_eq!(header["type"], "Distinct");
    assert_eq!(rule["limit"]["requests"], 3);
    assert_eq!(rule["limit"]["unit"], "Hour");
    let fixture = std::fs::read_to_string(format!("{MANIFEST}/tests/fixtures/envoy-gateway.yaml"))
        .expect("fixture");
    assert!(
        fixture.contains("header_name: x-user-id")
            && fixture.contains("descriptor_key: rule-0-match-0"),
        "the end-to-end fixture sends the header as Envoy Gateway does"
    );
}

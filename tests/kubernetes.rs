//! The Kubernetes manifests (conf/k8s/): the base's prefill and decode pools fit together (the
//! Service tokenonce's prefill leg calls selects the prefill pods on the engine's port, both
//! engines speak NIXL on their pod IP), the decode pod's tokenonce config passes `tokenonce check`
//! and matches its mounts, ports and probes, its shutdown timings fit the grace period, and the
//! llm-d overlay's config passes too. Rendering with kustomize and the Kubernetes schemas:
//! tests/k8s/validate.sh (CI).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml_ng::Value as Yaml;

/// A file of this repository.
fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A path on disk as a `&str` (temp dirs and the checkout are UTF-8 here).
fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Every YAML document of `file`.
fn yaml_documents(file: &Path) -> Vec<Yaml> {
    let text = read(file);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Yaml::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", file.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// The resources a kustomization without patches builds: its `resources` files and a ConfigMap
/// per `configMapGenerator` entry (under its plain name; kustomize adds a content hash).
fn kustomize_base(dir: &str) -> Vec<Yaml> {
    let dir = repo(dir);
    let kustomization = &yaml_documents(&dir.join("kustomization.yaml"))[0];
    let mut docs = Vec::new();
    for file in kustomization["resources"].as_sequence().expect("resources") {
        docs.extend(yaml_documents(&dir.join(file.as_str().unwrap())));
    }
    for generator in kustomization["configMapGenerator"].as_sequence().into_iter().flatten() {
        let mut data = serde_yaml_ng::Mapping::new();
        for file in generator["files"].as_sequence().expect("files") {
            let file = file.as_str().unwrap();
            data.insert(Yaml::from(file), Yaml::from(read(&dir.join(file))));
        }
        let mut map = serde_yaml_ng::Mapping::new();
        map.insert("kind".into(), "ConfigMap".into());
        map.insert(
            "metadata".into(),
            serde_yaml_ng::from_str(&format!("{{name: {}}}", generator["name"].as_str().unwrap())).unwrap(),
        );
        map.insert("data".into(), Yaml::Mapping(data));
        docs.push(Yaml::Mapping(map));
    }
    docs
}

fn of_kind<'a>(docs: &'a [Yaml], kind: &str) -> Vec<&'a Yaml> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn named<'a>(docs: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A container port given by number or by name.
fn port_number(container: &Yaml, port: &Yaml) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("port is a number or a name");
    container["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}"))
}

/// Seconds a preStop hook waits: the native `sleep` action, `exec: [sleep, N]`, or
/// tokenonce's admin `GET /drain?wait_seconds=N`.
fn prestop_seconds(container: &Yaml) -> u64 {
    let hook = &container["lifecycle"]["preStop"];
    if let Some(s) = hook["sleep"]["seconds"].as_u64() {
        return s;
    }
    if let Some(path) = hook["httpGet"]["path"].as_str() {
        assert!(path.starts_with("/drain?"), "an httpGet preStop must call /drain: {path}");
        return path.split("wait_seconds=").nth(1).and_then(|v| v.parse().ok()).expect("wait_seconds");
    }
    let cmd: Vec<&str> =
        hook["exec"]["command"].as_sequence().expect("a preStop sleep").iter().filter_map(Yaml::as_str).collect();
    let n = cmd.iter().rev().find_map(|w| w.parse::<u64>().ok());
    assert!(cmd.iter().any(|w| w.contains("sleep")), "preStop must sleep: {cmd:?}");
    n.expect("preStop sleep seconds")
}

fn port_of(host_port: &str) -> u64 {
    host_port.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or_else(|| panic!("{host_port}: host:port"))
}

/// The pod template's containers of a Deployment.
fn containers(deploy: &Yaml) -> &Vec<Yaml> {
    deploy["spec"]["template"]["spec"]["containers"].as_sequence().expect("containers")
}

/// A vLLM container's args split at `=`, and the value after `flag`.
fn engine_arg(engine: &Yaml, flag: &str) -> String {
    let args: Vec<String> = engine["args"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(Yaml::as_str)
        .flat_map(|a| a.splitn(2, '=').map(str::to_owned).collect::<Vec<_>>())
        .collect();
    let i = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("engine arg {flag}"));
    args[i + 1].clone()
}

/// The engine speaks NIXL: the connector in its KV transfer config, the side channel on the pod
/// IP, its port declared by the container.
fn assert_nixl(engine: &Yaml) {
    let kv: serde_json::Value = serde_json::from_str(&engine_arg(engine, "--kv-transfer-config")).unwrap();
    assert_eq!(kv["kv_connector"], "NixlConnector", "{}", engine["name"].as_str().unwrap());
    let env = engine["env"].as_sequence().expect("env");
    let var = |name: &str| env.iter().find(|e| e["name"] == name).unwrap_or_else(|| panic!("env {name}"));
    assert_eq!(var("VLLM_NIXL_SIDE_CHANNEL_HOST")["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    let side_port: u64 = var("VLLM_NIXL_SIDE_CHANNEL_PORT")["value"].as_str().unwrap().parse().unwrap();
    assert_eq!(port_number(engine, &Yaml::from("nixl")), side_port, "the side channel port is declared");
}

/// The Service selects exactly the pods of `deploy` (every selector label is on its template).
fn assert_selects(service: &Yaml, deploy: &Yaml) {
    let selector = service["spec"]["selector"].as_mapping().expect("selector");
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(&deploy["spec"]["template"]["metadata"]["labels"][k], v, "the Service selects the pod");
    }
}

/// `tokenonce check` on `toml_text`, its admin token file replaced by a copy of `token`.
fn check_config(toml_text: &str, token: &str) {
    let config: toml::Table = toml::from_str(toml_text).unwrap();
    let token_path = config["server"]["admin_token_file"].as_str().expect("server.admin_token_file");
    let dir = tempfile::tempdir().unwrap();
    let token_copy = dir.path().join("token");
    std::fs::write(&token_copy, token).unwrap();
    let file = dir.path().join("tokenonce.toml");
    std::fs::write(&file, toml_text.replace(token_path, path_str(&token_copy))).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokenonce")).args(["check", path_str(&file)]).output().unwrap();
    assert!(
        out.status.success(),
        "tokenonce check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn admin_token(docs: &[Yaml]) -> String {
    named(docs, "Secret", "tokenonce-admin")["stringData"]["token"].as_str().expect("stringData.token").to_owned()
}

/// The decode pod: its ConfigMap holds a tokenonce config that `tokenonce check` accepts and
/// that matches the Deployment (mount path, ports, decode address); the tokenonce container has
/// the probes, scrape annotations and preStop hook; the pod's termination grace period covers
/// the preStop wait plus pingora's grace and shutdown timeouts, and the engine outlives tokenonce.
#[test]
fn base_decode_pod_is_valid_and_stops_within_its_grace_period() {
    let docs = kustomize_base("conf/k8s/base");

    // The ConfigMap and its TOML, checked by the real binary.
    let map = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|m| m["data"]["tokenonce.toml"].is_string())
        .expect("a ConfigMap holding tokenonce.toml");
    let toml_text = map["data"]["tokenonce.toml"].as_str().unwrap();
    let token = admin_token(&docs);
    check_config(toml_text, &token);
    let config: toml::Table = toml::from_str(toml_text).unwrap();
    let token_path = config["server"]["admin_token_file"].as_str().unwrap();
    let server = config["server"].as_table().expect("[server]");
    let listen = server["listen"].as_str().unwrap();
    let admin_listen = server["admin_listen"].as_str().unwrap();
    assert!(listen.starts_with("0.0.0.0:"), "the pod IP must reach the client listener");
    assert!(
        admin_listen.starts_with("0.0.0.0:"),
        "kubelet probes and Prometheus reach the admin listener on the pod IP"
    );
    let grace = server["grace_period_seconds"].as_integer().expect("server.grace_period_seconds");
    let shutdown =
        server["graceful_shutdown_timeout_seconds"].as_integer().expect("server.graceful_shutdown_timeout_seconds");

    // The decode Deployment: the one with tokenonce beside a vLLM engine.
    let deploy = named(&docs, "Deployment", "vllm-decode");
    let pod = &deploy["spec"]["template"];
    let tokenonce = containers(deploy).iter().find(|c| c["name"] == "tokenonce").expect("a container named tokenonce");
    assert_eq!(tokenonce["image"], "tokenonce", "the image kustomization.yaml `images:` sets");
    let engine = containers(deploy)
        .iter()
        .find(|c| c["image"].as_str().is_some_and(|i| i.starts_with("vllm/vllm-openai")))
        .expect("a vllm/vllm-openai container");

    // The preStop hook authenticates with the Secret's token, mounted where the config reads it.
    let headers = tokenonce["lifecycle"]["preStop"]["httpGet"]["httpHeaders"].as_sequence().expect("preStop headers");
    let bearer = headers.iter().find(|h| h["name"] == "Authorization").and_then(|h| h["value"].as_str());
    assert_eq!(bearer, Some(format!("Bearer {token}").as_str()), "the /drain hook must send the admin token");
    let volume_of = |dir: &Path| {
        let mount = tokenonce["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"].as_str().map(Path::new) == Some(dir))
            .unwrap_or_else(|| panic!("a volume mounted at {}", dir.display()));
        pod["spec"]["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == mount["name"])
            .expect("the mounted volume")
    };
    let secret_volume = volume_of(Path::new(token_path).parent().unwrap());
    assert_eq!(secret_volume["secret"]["secretName"], "tokenonce-admin");

    // tokenonce reads the ConfigMap's key at the path its args name.
    let args: Vec<&str> = tokenonce["args"].as_sequence().expect("args").iter().filter_map(Yaml::as_str).collect();
    let at = args.iter().position(|a| *a == "--config").expect("--config");
    let config_path = Path::new(args[at + 1]);
    assert_eq!(config_path.file_name().and_then(|f| f.to_str()), Some("tokenonce.toml"));
    let volume = volume_of(config_path.parent().unwrap());
    assert_eq!(volume["configMap"]["name"], map["metadata"]["name"], "the volume is the ConfigMap");

    // Probes on the admin port, scrape annotations for it.
    let admin_port = port_of(admin_listen);
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &tokenonce[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(port_number(tokenonce, &get["port"]), admin_port, "{probe} on the admin port");
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"].as_str(), Some(admin_port.to_string().as_str()));
    assert_eq!(annotations["prometheus.io/path"], "/metrics");

    // Shutdown: preStop, then pingora's grace period and shutdown timeout, all inside the pod's
    // termination grace period; the engine gets SIGTERM only after tokenonce has exited.
    let termination = pod["spec"]["terminationGracePeriodSeconds"].as_u64().expect("terminationGracePeriodSeconds");
    let prestop = prestop_seconds(tokenonce);
    assert!(prestop >= 5, "preStop must leave endpoints time to update: {prestop} s");
    let tokenonce_done = prestop + u64::try_from(grace + shutdown).unwrap();
    assert!(
        termination > tokenonce_done,
        "terminationGracePeriodSeconds {termination} must exceed preStop {prestop} + grace {grace} + shutdown {shutdown}"
    );
    let engine_prestop = prestop_seconds(engine);
    assert!(
        engine_prestop >= tokenonce_done && engine_prestop < termination,
        "the engine's preStop ({engine_prestop} s) must outlast tokenonce ({tokenonce_done} s) within {termination} s"
    );

    // The engine serves on the address the decode pool names, on loopback only, with NIXL.
    let decode = config["pools"]["decode"]["endpoints"].as_array().expect("pools.decode.endpoints");
    assert_eq!(decode.len(), 1);
    let decode = decode[0].as_str().unwrap();
    assert_eq!(format!("{}:{}", engine_arg(engine, "--host"), engine_arg(engine, "--port")), decode);
    assert!(decode.starts_with("127.0.0.1:"));
    assert_nixl(engine);

    // The decode Service sends clients to tokenonce's listener.
    let service = named(&docs, "Service", "vllm-decode");
    assert_eq!(port_number(tokenonce, &service["spec"]["ports"][0]["targetPort"]), port_of(listen));
    assert_eq!(service["spec"]["ports"].as_sequence().unwrap().len(), 1, "the admin port stays out of the Service");
    assert_selects(service, deploy);
}

/// The prefill pool is what tokenonce's prefill leg calls: the pool's endpoint is the prefill
/// Service by name and port, the Service selects the prefill pods and targets the port the
/// engine listens on (all interfaces: it is reached through the Service), the engine speaks NIXL,
/// and its preStop keeps it up through the endpoint update and the 30 s KV lease.
#[test]
fn base_prefill_pool_is_the_service_tokenonce_calls() {
    let docs = kustomize_base("conf/k8s/base");
    let map = of_kind(&docs, "ConfigMap").into_iter().find(|m| m["data"]["tokenonce.toml"].is_string()).unwrap();
    let config: toml::Table = toml::from_str(map["data"]["tokenonce.toml"].as_str().unwrap()).unwrap();
    let endpoints = config["pools"]["prefill"]["endpoints"].as_array().expect("pools.prefill.endpoints");
    assert_eq!(endpoints.len(), 1, "one Service in front of the prefill pods");
    let (name, port) = endpoints[0].as_str().unwrap().rsplit_once(':').unwrap();
    let port: u64 = port.parse().unwrap();

    let service = named(&docs, "Service", name);
    let deploy = named(&docs, "Deployment", "vllm-prefill");
    assert_selects(service, deploy);
    let decode_pod = &named(&docs, "Deployment", "vllm-decode")["spec"]["template"]["metadata"]["labels"];
    let selector = service["spec"]["selector"].as_mapping().unwrap();
    assert!(selector.iter().any(|(k, v)| &decode_pod[k] != v), "the prefill Service must not select decode pods");
    let ports = service["spec"]["ports"].as_sequence().unwrap();
    let engine = &containers(deploy)[0];
    let to = ports.iter().find(|p| p["port"].as_u64() == Some(port)).expect("the Service port tokenonce calls");
    let engine_port: u64 = engine_arg(engine, "--port").parse().unwrap();
    assert_eq!(port_number(engine, &to["targetPort"]), engine_port);
    assert_eq!(engine_arg(engine, "--host"), "0.0.0.0");
    assert_nixl(engine);
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(engine[probe]["httpGet"]["path"], "/health", "{probe}");
    }

    let kv_lease = 30;
    let prestop = prestop_seconds(engine);
    let termination = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(prestop >= 5 + kv_lease, "the prefill must hold its blocks through the KV lease: preStop {prestop} s");
    assert!(termination > prestop, "terminationGracePeriodSeconds {termination} must exceed preStop {prestop}");
    let route = config["routes"].as_array().unwrap().iter().find(|r| r["prefill"]["pool"].as_str() == Some("prefill"));
    assert!(route.is_some(), "a route runs its prefill leg on this pool");
}

/// The llm-d overlay replaces the base's config with the header route, keeps the base's
/// `[server]` (so the decode pod's shutdown timeline still holds) and passes `tokenonce check`.
#[test]
fn llm_d_overlay_config_passes_check_and_keeps_the_base_server() {
    let overlay = repo("conf/k8s/overlays/llm-d");
    let kustomization = &yaml_documents(&overlay.join("kustomization.yaml"))[0];
    let generator = &kustomization["configMapGenerator"][0];
    assert_eq!(generator["name"], "tokenonce-config");
    assert_eq!(generator["behavior"], "replace");
    let text = read(&overlay.join(generator["files"][0].as_str().unwrap()));
    let base = kustomize_base("conf/k8s/base");
    check_config(&text, &admin_token(&base));

    let config: toml::Table = toml::from_str(&text).unwrap();
    let base_map = of_kind(&base, "ConfigMap").into_iter().find(|m| m["data"]["tokenonce.toml"].is_string()).unwrap();
    let base_config: toml::Table = toml::from_str(base_map["data"]["tokenonce.toml"].as_str().unwrap()).unwrap();
    assert_eq!(config["server"], base_config["server"], "the overlay keeps the base's [server]");
    assert_eq!(config["pools"]["decode"], base_config["pools"]["decode"]);
    let routes = config["routes"].as_array().unwrap();
    assert!(
        routes.iter().any(|r| r["prefill"]["header"].as_str() == Some("x-prefiller-host-port")),
        "a route takes its prefiller from llm-d's header"
    );
}

//! The Kubernetes manifests (conf/k8s/): the base's prefill and decode pools fit together (the
//! headless Service tokenonce's prefill leg calls selects the prefill pods on the engine's port,
//! both engines speak NIXL on their pod IP), the decode pod's tokenonce config passes `tokenonce
//! check` and matches its mounts, ports, probes and drain hook, its shutdown timings fit the
//! grace period, the model volume is the one engines and tokenonce share, every container has
//! requests and limits, each pool has its disruption budget, spread, network policy and
//! monitor, the PrometheusRule is conf/prometheus/alerts.yml, and the llm-d overlay's config
//! passes too. Rendering with kustomize and the Kubernetes and Prometheus Operator schemas:
//! tests/k8s/validate.sh (CI).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;
use std::process::Command;

use serde::Deserialize;
use serde_yaml_ng::Value as Yaml;
use support::{path_str, repo};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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
/// `exec: [tokenonce, ..., drain, --wait-seconds, N]`.
fn prestop_seconds(container: &Yaml) -> u64 {
    let hook = &container["lifecycle"]["preStop"];
    if let Some(s) = hook["sleep"]["seconds"].as_u64() {
        return s;
    }
    let cmd: Vec<&str> =
        hook["exec"]["command"].as_sequence().expect("a preStop exec").iter().filter_map(Yaml::as_str).collect();
    if cmd.contains(&"drain") {
        let at = cmd.iter().position(|w| *w == "--wait-seconds").expect("drain --wait-seconds");
        return cmd[at + 1].parse().expect("--wait-seconds N");
    }
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

/// `tokenonce check` on `toml_text`, with the pod's files it names made here: its admin token
/// file a copy of `token`, its model folder (every pool's `tokenizer`) a small model with a
/// tokenizer and chat template, so local ids and the parity watch load as in the pod.
fn check_config(toml_text: &str, token: &str) {
    let config: toml::Table = toml::from_str(toml_text).unwrap();
    let token_path = config["server"]["admin_token_file"].as_str().expect("server.admin_token_file");
    let dir = tempfile::tempdir().unwrap();
    let token_copy = dir.path().join("token");
    std::fs::write(&token_copy, token).unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    support::write_local_model(&model);
    let mut text = toml_text.replace(token_path, path_str(&token_copy));
    for pool in config["pools"].as_table().expect("[pools]").values() {
        if let Some(folder) = pool.get("tokenizer").and_then(toml::Value::as_str) {
            text = text.replace(&format!("\"{folder}\""), &format!("\"{}\"", path_str(&model)));
        }
    }
    let file = dir.path().join("tokenonce.toml");
    std::fs::write(&file, text).unwrap();
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
    let engine = containers(deploy).iter().find(|c| c["name"] == "vllm-decode").expect("the engine container");

    // The image is registry-qualified, its tag set by kustomization.yaml `images:` under the
    // name the manifest writes (so `kustomize edit set image` moves it).
    let image = tokenonce["image"].as_str().unwrap();
    let (name, _tag) = image.rsplit_once(':').expect("a tagged image");
    assert!(name.split('/').next().unwrap().contains('.'), "a registry host: {image}");
    let kustomization = &yaml_documents(&repo("conf/k8s/base/kustomization.yaml"))[0];
    let entry = kustomization["images"].as_sequence().unwrap().iter().find(|i| i["name"] == name);
    assert_eq!(entry.expect("an images: entry")["newTag"], env!("CARGO_PKG_VERSION"), "the release's image");

    // The preStop hook is the image's binary draining with the config it runs on, which names
    // the token file, mounted from the Secret: no token in the manifest.
    let hook: Vec<&str> = tokenonce["lifecycle"]["preStop"]["exec"]["command"]
        .as_sequence()
        .expect("an exec preStop")
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(hook[0], "/usr/local/bin/tokenonce", "the image's binary (Dockerfile, no shell)");
    let hook_config = hook.iter().position(|w| *w == "--config").map(|at| hook[at + 1]);
    assert!(hook.contains(&"drain"), "{hook:?}");
    assert!(!read(&repo("conf/k8s/base/decode.yaml")).contains(&token), "the token is in no manifest");
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
    assert_eq!(hook_config, Some(args[at + 1]), "the drain hook reads the running config");
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

    // The engine and tokenonce mount the same model folder, which the engine serves and the
    // config's pools take their tokenizer from (local ids on, the parity watch sampling).
    let model_dir = config["pools"]["decode"]["tokenizer"].as_str().expect("pools.decode.tokenizer");
    assert_eq!(engine["args"][0].as_str(), Some(model_dir), "the engine serves the model folder");
    assert_eq!(model_mount(deploy, engine, model_dir), model_mount(deploy, tokenonce, model_dir));
    assert_eq!(config["pools"]["prefill"]["tokenizer"].as_str(), Some(model_dir));
    assert_eq!(config["pools"]["prefill"]["local_ids"].as_str(), Some("on"));
    assert!(config["routes"][0]["parity_sample"].as_float().unwrap() > 0.0, "the parity watch samples");
    // The decode Service sends clients to tokenonce's listener.
    let service = named(&docs, "Service", "vllm-decode");
    assert_eq!(port_number(tokenonce, &service["spec"]["ports"][0]["targetPort"]), port_of(listen));
    assert_eq!(service["spec"]["ports"].as_sequence().unwrap().len(), 1, "the admin port stays out of the Service");
    assert_selects(service, deploy);
}

/// The prefill pool is what tokenonce's prefill leg calls: the pool's endpoint is the prefill
/// Service by name and port, the Service is headless and selects the prefill pods and targets the port the
/// engine listens on (all interfaces: it is reached through the Service), the engine speaks NIXL,
/// and its preStop keeps it up through the endpoint update and the 30 s KV lease.
#[test]
fn base_prefill_pool_is_the_service_tokenonce_calls() {
    let docs = kustomize_base("conf/k8s/base");
    let map = of_kind(&docs, "ConfigMap").into_iter().find(|m| m["data"]["tokenonce.toml"].is_string()).unwrap();
    let config: toml::Table = toml::from_str(map["data"]["tokenonce.toml"].as_str().unwrap()).unwrap();
    // Discovered: the headless Service's name, looked up for one endpoint per prefill pod.
    assert!(config["pools"]["prefill"].get("endpoints").is_none(), "the prefill pool is discovered, not listed");
    let discover = config["pools"]["prefill"]["discover"].as_str().expect("pools.prefill.discover");
    let (name, port) = discover.rsplit_once(':').unwrap();
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
    // Headless: the name resolves to the pods themselves, so the port tokenonce calls is the
    // engine's own, not one kube-proxy maps.
    assert_eq!(service["spec"]["clusterIP"], "None", "one address per prefill pod");
    assert_eq!(port, engine_port);
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

/// The claim and sub-path mounted at `dir` in `container` of `deploy`'s pods (read-only).
fn model_mount(deploy: &Yaml, container: &Yaml, dir: &str) -> (String, String) {
    let mount = container["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"] == dir)
        .unwrap_or_else(|| panic!("{} mounts nothing at {dir}", container["name"].as_str().unwrap()));
    assert_eq!(mount["readOnly"], true, "the model is read-only in the pods");
    let volume = deploy["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    let claim = volume["persistentVolumeClaim"]["claimName"].as_str().expect("a PVC").to_owned();
    (claim, mount["subPath"].as_str().unwrap_or_default().to_owned())
}

/// Both pools serve the model from the one volume the Job fills: the prefill engine mounts the
/// decode pod's claim and folder, the claim exists, and the Job writes that folder, its
/// Hugging Face token from a Secret reference.
#[test]
fn base_model_volume_is_shared_by_both_pools_and_filled_by_the_job() {
    let docs = kustomize_base("conf/k8s/base");
    let decode = named(&docs, "Deployment", "vllm-decode");
    let prefill = named(&docs, "Deployment", "vllm-prefill");
    let decode_engine = containers(decode).iter().find(|c| c["name"] == "vllm-decode").unwrap();
    let prefill_engine = &containers(prefill)[0];
    let dir = decode_engine["args"][0].as_str().unwrap();
    let (claim, sub_path) = model_mount(decode, decode_engine, dir);
    assert_eq!(model_mount(prefill, prefill_engine, dir), (claim.clone(), sub_path.clone()));
    assert_eq!(prefill_engine["args"][0].as_str(), Some(dir));
    for engine in [decode_engine, prefill_engine] {
        assert_eq!(engine_arg(engine, "--served-model-name"), engine_arg(decode_engine, "--served-model-name"));
    }
    named(&docs, "PersistentVolumeClaim", &claim);

    let job = named(&docs, "Job", "model-download");
    let pod = &job["spec"]["template"]["spec"];
    let download = &pod["containers"][0];
    let mount = &download["volumeMounts"][0];
    let volume = pod["volumes"].as_sequence().unwrap().iter().find(|v| v["name"] == mount["name"]).unwrap();
    assert_eq!(volume["persistentVolumeClaim"]["claimName"].as_str(), Some(claim.as_str()));
    let script = download["args"][0].as_str().unwrap();
    let target = format!("{}/{sub_path}", mount["mountPath"].as_str().unwrap());
    assert!(script.contains(&format!("local_dir=\"{target}\"")), "the Job fills {target}: {script}");
    let env = download["env"].as_sequence().unwrap();
    let hf = env.iter().find(|e| e["name"] == "HF_TOKEN").expect("HF_TOKEN");
    assert_eq!(hf["valueFrom"]["secretKeyRef"]["name"], "hf-token");
}

/// Every container of every workload requests and limits CPU and memory; GPU engines request
/// and limit their GPU alike.
#[test]
fn base_every_container_has_requests_and_limits() {
    let docs = kustomize_base("conf/k8s/base");
    let mut seen = 0;
    for workload in docs.iter().filter(|d| d["kind"] == "Deployment" || d["kind"] == "Job") {
        let spec = &workload["spec"]["template"]["spec"];
        for c in spec["containers"].as_sequence().into_iter().chain(spec["initContainers"].as_sequence()).flatten() {
            let name = c["name"].as_str().unwrap();
            for side in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(!c["resources"][side][resource].is_null(), "{name}: no {side}.{resource}");
                }
            }
            assert_eq!(
                c["resources"]["requests"]["nvidia.com/gpu"], c["resources"]["limits"]["nvidia.com/gpu"],
                "{name}"
            );
            seen += 1;
        }
    }
    assert_eq!(seen, 4, "two engines, tokenonce, the model Job");
}

/// Each pool has a PodDisruptionBudget that lets a drain evict one pod at a time (never none:
/// one replica with minAvailable 1 would block drains), spreads over nodes and zones, has a
/// NetworkPolicy, and is scraped: tokenonce on its admin port, vLLM on each pod's `http` port
/// (the prefill engine itself; on a decode pod tokenonce, passing /metrics to its engine).
#[test]
fn base_pools_have_budgets_spread_policies_and_monitors() {
    let docs = kustomize_base("conf/k8s/base");
    let selects = |selector: &Yaml, pod: &Yaml| {
        let labels = &pod["spec"]["template"]["metadata"]["labels"];
        let by_labels = selector["matchLabels"].as_mapping().into_iter().flatten().all(|(k, v)| &labels[k] == v);
        let by_exprs = selector["matchExpressions"].as_sequence().into_iter().flatten().all(|e| {
            e["operator"] == "In" && e["values"].as_sequence().unwrap().contains(&labels[e["key"].as_str().unwrap()])
        });
        by_labels && by_exprs
    };
    for pool in ["vllm-prefill", "vllm-decode"] {
        let deploy = named(&docs, "Deployment", pool);
        let pdb = named(&docs, "PodDisruptionBudget", pool);
        assert!(selects(&pdb["spec"]["selector"], deploy), "{pool}: the PDB selects the pool");
        assert_eq!(pdb["spec"]["maxUnavailable"], 1, "{pool}");
        let spread = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"].as_sequence().expect("spread");
        let keys: Vec<&str> = spread.iter().filter_map(|t| t["topologyKey"].as_str()).collect();
        assert_eq!(keys, ["kubernetes.io/hostname", "topology.kubernetes.io/zone"], "{pool}");
        assert!(spread.iter().all(|t| selects(&t["labelSelector"], deploy)), "{pool}: spread counts its own pods");
        let policy = named(&docs, "NetworkPolicy", pool);
        assert!(selects(&policy["spec"]["podSelector"], deploy), "{pool}");
        let vllm = named(&docs, "PodMonitor", "vllm");
        assert!(selects(&vllm["spec"]["selector"], deploy), "{pool}: vLLM's metrics scraped");
        let port = vllm["spec"]["podMetricsEndpoints"][0]["port"].as_str().unwrap();
        assert!(
            containers(deploy).iter().any(|c| c["ports"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == port)),
            "{pool}: a container port named {port}"
        );
    }
    let decode = named(&docs, "Deployment", "vllm-decode");
    let tokenonce = containers(decode).iter().find(|c| c["name"] == "tokenonce").unwrap();
    let monitor = named(&docs, "PodMonitor", "tokenonce");
    assert!(selects(&monitor["spec"]["selector"], decode));
    assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["port"], "admin");
    assert_eq!(port_number(tokenonce, &Yaml::from("admin")), 9000);
    assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["path"], "/metrics");

    // The decode policy opens tokenonce's client port to all and its admin port to the
    // monitoring namespace only; the prefill policy admits the decode pods.
    let rules = named(&docs, "NetworkPolicy", "vllm-decode")["spec"]["ingress"].as_sequence().unwrap();
    let open =
        |port: &str| rules.iter().find(|r| r["ports"].as_sequence().into_iter().flatten().any(|p| p["port"] == port));
    assert!(open("http").unwrap()["from"].is_null(), "clients reach tokenonce from anywhere");
    let admin_from = &open("admin").unwrap()["from"][0]["namespaceSelector"]["matchLabels"];
    assert_eq!(admin_from["kubernetes.io/metadata.name"], "monitoring");
    let prefill_rules = named(&docs, "NetworkPolicy", "vllm-prefill")["spec"]["ingress"].as_sequence().unwrap();
    assert!(
        prefill_rules
            .iter()
            .any(|r| r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "vllm-decode"
                && r["ports"].is_null()),
        "decode pods reach the prefill pods on every port (HTTP, NIXL side channel, UCX)"
    );
}

/// The PrometheusRule carries exactly the groups of conf/prometheus/alerts.yml (what `promtool`
/// tests). `TOKENONCE_BLESS=1 cargo test --test kubernetes` rewrites it from that file.
#[test]
fn prometheus_rule_is_the_alerts_file() {
    let alerts = &yaml_documents(&repo("conf/prometheus/alerts.yml"))[0];
    let path = repo("conf/k8s/base/prometheus-rule.yaml");
    if std::env::var_os("TOKENONCE_BLESS").is_some_and(|v| v == "1") {
        let mut spec = serde_yaml_ng::Mapping::new();
        spec.insert("groups".into(), alerts["groups"].clone());
        let rule: Yaml = serde_yaml_ng::from_str(
            "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n  name: tokenonce\n  labels:\n    \
             app.kubernetes.io/name: vllm-decode\n    app.kubernetes.io/component: tokenonce\n",
        )
        .unwrap();
        let mut rule = rule.as_mapping().unwrap().clone();
        rule.insert("spec".into(), Yaml::Mapping(spec));
        let header = "# conf/prometheus/alerts.yml as a PrometheusRule for the Prometheus Operator (your Prometheus\n\
                      # selects rules by label: add its ruleSelector's). Generated: edit alerts.yml, then\n\
                      # `TOKENONCE_BLESS=1 cargo test --test kubernetes`; tests/kubernetes.rs keeps them equal.\n";
        std::fs::write(&path, format!("{header}{}", serde_yaml_ng::to_string(&rule).unwrap())).unwrap();
    }
    let rule = &yaml_documents(&path)[0];
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(
        rule["spec"]["groups"], alerts["groups"],
        "prometheus-rule.yaml differs from conf/prometheus/alerts.yml: TOKENONCE_BLESS=1 cargo test --test kubernetes"
    );
    let base = &yaml_documents(&repo("conf/k8s/base/kustomization.yaml"))[0];
    assert!(base["resources"].as_sequence().unwrap().iter().any(|r| r == "prometheus-rule.yaml"));
}

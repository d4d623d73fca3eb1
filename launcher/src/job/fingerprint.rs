//! What must be the same on every node of a job, and the check that it is.
//!
//! Each node's launcher resolves its config (file, `--set` overrides, defaults) and adds what
//! its command line and data decide: the device, ranks per node, node count, the step it
//! resumes from, the number of training tokens its `data.path` holds, and the launcher
//! version. That is the node's fingerprint, a sorted list of `key = value` pairs; its ranks
//! send it in their hello, and node 0 compares it with its own, refusing a node that differs
//! with a message naming every differing key and both values (two nodes training with
//! different learning rates, seeds, data or step counts would otherwise finish "fine").
//!
//! `output.dir` is left out (each node writes its own logs); paths are compared as written
//! in the config, before they are made absolute (nodes may start in different directories).

use trainer::Config;

/// This build's version, as compared between nodes.
pub const BUILD: &str = env!("CARGO_PKG_VERSION");

/// A node's fingerprint: `(key, value)`, sorted by key, keys unique.
pub type Fingerprint = Vec<(String, String)>;

/// Keys that may differ between nodes.
const NODE_LOCAL: [&str; 1] = ["output.dir"];

/// The launch facts that are not in the config file.
#[derive(Debug, Clone)]
pub struct Launch {
    pub device: &'static str,
    pub ranks_per_node: usize,
    pub nnodes: usize,
    pub resume_step: Option<u64>,
    pub train_tokens: usize,
}

/// The fingerprint of `cfg` (as loaded, paths as written) launched as `launch`.
pub fn of(cfg: &Config, launch: &Launch) -> Fingerprint {
    let mut out: Fingerprint = Vec::new();
    if let Ok(toml::Value::Table(sections)) = toml::Value::try_from(cfg) {
        for (section, value) in sections {
            flatten(&section, &value, &mut out);
        }
    }
    out.retain(|(k, _)| !NODE_LOCAL.contains(&k.as_str()));
    out.extend([
        ("launch.device".to_string(), launch.device.to_string()),
        ("launch.ranks_per_node".to_string(), launch.ranks_per_node.to_string()),
        ("launch.nnodes".to_string(), launch.nnodes.to_string()),
        ("launch.resume_step".to_string(), launch.resume_step.map_or("none".to_string(), |s| s.to_string())),
        ("data.train_tokens".to_string(), launch.train_tokens.to_string()),
        ("launcher.version".to_string(), BUILD.to_string()),
    ]);
    out.sort();
    out
}

fn flatten(prefix: &str, value: &toml::Value, out: &mut Fingerprint) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                flatten(&format!("{prefix}.{k}"), v, out);
            }
        }
        // Config floats are f32: show them as such (0.001, not 0.0010000000474974513).
        toml::Value::Float(x) if (*x as f32) as f64 == *x => out.push((prefix.to_string(), (*x as f32).to_string())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

/// Every key whose value differs, as `key = theirs on <them> but ours on <us>`, or empty.
pub fn differences(ours: &Fingerprint, theirs: &Fingerprint, us: &str, them: &str) -> Vec<String> {
    let get = |f: &Fingerprint, k: &str| f.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    let mut keys: Vec<&String> = ours.iter().chain(theirs.iter()).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (get(ours, k), get(theirs, k));
            (a != b).then(|| {
                let show = |v: Option<String>| v.unwrap_or_else(|| "unset".to_string());
                format!("{k} = {} on {them} but {} on {us}", show(b), show(a))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &[&str]) -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nvocab_size = 11\nseq_len = 4\n")
            .expect("write");
        let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Config::load(&p, &o).expect("config")
    }

    fn launch() -> Launch {
        Launch { device: "cpu", ranks_per_node: 2, nnodes: 2, resume_step: None, train_tokens: 1000 }
    }

    #[test]
    fn every_differing_key_is_named_with_both_values() {
        let a = of(&cfg(&[]), &launch());
        assert!(a.windows(2).all(|w| w[0].0 < w[1].0), "sorted, unique");
        assert!(a.iter().any(|(k, v)| k == "train.lr" && v.contains("0.0006")), "{a:?}");
        assert!(!a.iter().any(|(k, _)| k == "output.dir"), "node-local");
        assert!(differences(&a, &a.clone(), "node 0", "node 1").is_empty());
        assert!(differences(&a, &of(&cfg(&["output.dir='elsewhere'"]), &launch()), "node 0", "node 1").is_empty());

        let b = of(
            &cfg(&["train.lr=0.001", "train.seed=7", "data.path='other/data'", "train.steps=30"]),
            &Launch { resume_step: Some(4), train_tokens: 999, ..launch() },
        );
        let d = differences(&a, &b, "node 0", "node 1");
        let text = d.join("; ");
        for key in ["train.lr", "train.seed", "data.path", "train.steps", "launch.resume_step", "data.train_tokens"] {
            assert!(text.contains(key), "{key} missing: {text}");
        }
        assert_eq!(d.len(), 6, "{text}");
        assert!(text.contains("train.lr = 0.001 on node 1 but 0.0006"), "{text}");
        assert!(text.contains("data.path = \"other/data\" on node 1 but unset on node 0"), "{text}");
    }
}

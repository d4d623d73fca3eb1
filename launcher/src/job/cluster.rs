//! Where this launcher stands in a job, read from the environment a scheduler sets: Slurm's
//! `SLURM_*` variables (`srun` tasks) or torchrun's (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...,
//! as Kubernetes operators and other schedulers set them). One pure function, [`resolve`],
//! turns them into [`FromEnv`] — how many launchers the job has, which one this is, the
//! rendezvous, the job token — or refuses a partial or contradictory environment naming the
//! variable; `setup.rs` then applies it under the explicit flags (`--nnodes`, `--node-rank`,
//! `--master-addr`, `--job-token` always win).
//!
//! Two shapes of job, as `setup.rs` runs them:
//! - **a launcher per node** (`srun --ntasks-per-node=1 launcher --gpus 8 CONFIG`): node K of
//!   N starts its own ranks K·G … K·G + G − 1, as `--nnodes N --node-rank K` do;
//! - **a launcher per rank** (`srun --ntasks-per-node=8 launcher --one-rank CONFIG`, or one
//!   process per GPU under torchrun): every task is a "node" of one rank of the multi-node
//!   machinery (rank = `SLURM_PROCID` / `RANK`, launchers = world), so rank 0's launcher hosts
//!   the rendezvous, the watchdog and the metrics as node 0's does, and the local index
//!   (`SLURM_LOCALID` / `LOCAL_RANK`) picks the GPU ([`gpu_of_local_rank`]).
//!
//! Slurm's pitfalls are handled here: a job step may use fewer nodes than its job, so the
//! step's values (`SLURM_STEP_NODELIST`, `SLURM_STEP_NUM_NODES`, `SLURM_STEP_NUM_TASKS`) win
//! over the job's; the batch script itself (no `SLURM_STEP_ID`) reads `SLURM_NODEID = 0` on
//! its one node, so a multi-node job must start the launcher with `srun`; the compressed node
//! list (`gpu[01-04,07],login2`) is expanded here ([`expand_nodelist`]: `scontrol` may not be
//! on the node), and its first host is the rendezvous.

use std::fmt;

/// What the launch asks for, which decides how the environment is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `--one-rank`: this process is one rank (a task per GPU); else a launcher per node.
    pub one_rank: bool,
    /// Ranks this launcher starts (`--cpus` / `--gpus`; 1 with `--one-rank`).
    pub ranks_per_launcher: usize,
}

/// A rendezvous host and port as written (resolved to an address by `setup.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl HostPort {
    /// `HOST:PORT`, `IP:PORT` or `[IPv6]:PORT`.
    pub fn parse(s: &str) -> Result<HostPort, String> {
        let bad = |why: &str| format!("{s:?} is not HOST:PORT ({why}), e.g. 10.0.0.1:29500 or gpu01:29500");
        let (host, port) = s.trim().rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(bad("no host"));
        }
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number from 1 to 65535"))?;
        if port == 0 {
            return Err(bad("port 0 is not a port others can reach"));
        }
        Ok(HostPort { host: host.to_string(), port })
    }
}

/// What the environment says about this launcher's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromEnv {
    /// Which environment, for messages: "the Slurm environment (job 7, step 0)".
    pub source: String,
    /// Launchers in the job (nodes; with `--one-rank`, ranks).
    pub nnodes: usize,
    /// This launcher's index among them (with `--one-rank`, its global rank).
    pub node_rank: usize,
    /// The rendezvous (node 0's launcher listens there), and the variables it came from.
    pub master: Option<HostPort>,
    pub master_from: String,
    /// `--one-rank`: the rank's index on its host (it picks the GPU); a launcher per node: 0.
    pub local_rank: usize,
    /// Ranks on this host, which share its memory (the fit check) and cores.
    pub ranks_per_host: usize,
    /// A job token derived from the environment (used when none is given), and from what.
    pub token: Option<(String, String)>,
}

/// Variables that select the torchrun-style reading (`MASTER_ADDR`/`MASTER_PORT` alone do not:
/// a Slurm batch script often exports them to choose the rendezvous).
const TORCHRUN_INDEX_VARS: [&str; 5] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"];

/// The lowest rendezvous port derived from a Slurm job id (`MASTER_PORT` unset): ports
/// `BASE .. BASE + SPAN`, below Linux's ephemeral range (32768 and up), so two jobs sharing a
/// node rarely meet and an outgoing connection never holds the port.
pub const SLURM_PORT_BASE: u16 = 15000;
const SLURM_PORT_SPAN: u64 = 10000;
/// A node list longer than this is refused (no real allocation is near it).
const MAX_HOSTS: usize = 1 << 20;

/// Read the environment through `get` (unset and empty variables read as `None`). `Ok(None)`:
/// no scheduler environment, or one that describes a single-node launch that needs nothing
/// from it (a Slurm batch script of a one-node job).
pub fn resolve(get: &dyn Fn(&str) -> Option<String>, req: Request) -> Result<Option<FromEnv>, String> {
    if TORCHRUN_INDEX_VARS.iter().any(|v| get(v).is_some()) {
        return torchrun(get, req).map(Some);
    }
    if get("SLURM_JOB_ID").is_some() {
        return slurm(get, req);
    }
    if req.one_rank {
        return Err("--one-rank reads this rank's place from the environment, and neither Slurm's (SLURM_PROCID, \
                    SLURM_NTASKS, ...: run it under srun) nor torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, \
                    MASTER_PORT) is set; or give it with --nnodes WORLD --node-rank RANK --master-addr HOST:PORT"
            .into());
    }
    Ok(None)
}

/// A variable as a number, or an error naming it.
fn number(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>, String> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| format!("{var}={v:?} is not a whole number: the environment is not one a scheduler set")),
    }
}

/// A variable that must be set.
fn required(get: &dyn Fn(&str) -> Option<String>, var: &str, why: &str) -> Result<usize, String> {
    number(get, var)?.ok_or_else(|| format!("{var} is not set, but {why}"))
}

/// The first of `vars` that is set: its name and value.
fn first_set(get: &dyn Fn(&str) -> Option<String>, vars: &[&'static str]) -> Option<(&'static str, String)> {
    vars.iter().find_map(|v| get(v).map(|x| (*v, x)))
}

fn first_number(
    get: &dyn Fn(&str) -> Option<String>,
    vars: &[&'static str],
) -> Result<Option<(&'static str, usize)>, String> {
    for v in vars {
        if let Some(n) = number(get, v)? {
            return Ok(Some((v, n)));
        }
    }
    Ok(None)
}

fn slurm(get: &dyn Fn(&str) -> Option<String>, req: Request) -> Result<Option<FromEnv>, String> {
    let job = get("SLURM_JOB_ID").unwrap_or_default();
    let job_nodes = first_number(get, &["SLURM_JOB_NUM_NODES", "SLURM_NNODES"])?.map_or(1, |(_, n)| n);
    let Some(step) = get("SLURM_STEP_ID").or_else(|| get("SLURM_STEPID")) else {
        if job_nodes <= 1 && !req.one_rank {
            // The batch script of a one-node job: a plain single-node launch.
            return Ok(None);
        }
        return Err(format!(
            "SLURM_STEP_ID is not set: this is Slurm job {job}'s batch script itself, not a task of a job step (there \
             SLURM_NODEID reads 0 whatever the node, so every node would claim to be node 0). Start the launcher \
             with srun: `srun --ntasks-per-node=1 launcher --gpus G CONFIG` (a launcher per node) or `srun \
             --ntasks-per-node=G launcher --one-rank CONFIG` (one per GPU); docs/user-guide/clusters.md has an sbatch script"
        ));
    };
    let source = format!("the Slurm environment (job {job}, step {step})");
    // The step's values: a step may run on fewer nodes, or fewer tasks, than its job.
    let (nodes_var, nnodes) = first_number(get, &["SLURM_STEP_NUM_NODES", "SLURM_NNODES"])?
        .ok_or("SLURM_STEP_NUM_NODES and SLURM_NNODES are not set, but a Slurm task needs its step's node count")?;
    let (tasks_var, ntasks) = first_number(get, &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?
        .ok_or("SLURM_STEP_NUM_TASKS and SLURM_NTASKS are not set, but a Slurm task needs its step's task count")?;
    let procid = required(get, "SLURM_PROCID", "a Slurm task needs its rank in the step")?;
    let nodeid = required(get, "SLURM_NODEID", "a Slurm task needs its node's index in the step")?;
    let localid = required(get, "SLURM_LOCALID", "a Slurm task needs its index on its node")?;
    if nnodes == 0 || ntasks == 0 {
        return Err(format!("{nodes_var}={nnodes}, {tasks_var}={ntasks}: a step has at least one node and task"));
    }
    if procid >= ntasks {
        return Err(format!(
            "SLURM_PROCID={procid} is not below {tasks_var}={ntasks}: the environment contradicts itself"
        ));
    }
    if nodeid >= nnodes {
        return Err(format!(
            "SLURM_NODEID={nodeid} is not below {nodes_var}={nnodes}: the environment contradicts itself"
        ));
    }
    if ntasks % nnodes != 0 {
        return Err(format!(
            "{tasks_var}={ntasks} is not a multiple of {nodes_var}={nnodes}: every node must run as many tasks \
             (srun --ntasks-per-node=1 for a launcher per node, --ntasks-per-node=G with --one-rank)"
        ));
    }
    let per_node = ntasks / nnodes;
    if localid >= per_node {
        return Err(format!(
            "SLURM_LOCALID={localid} is not below the {per_node} task(s) per node of {tasks_var}={ntasks} on \
             {nodes_var}={nnodes}: the environment contradicts itself"
        ));
    }
    let (list_var, list) = first_set(get, &["SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"])
        .ok_or("SLURM_STEP_NODELIST, SLURM_NODELIST and SLURM_JOB_NODELIST are not set, but the first host of the node list is the rendezvous")?;
    let hosts = expand_nodelist(&list).map_err(|e| format!("{list_var}={list:?}: {e}"))?;
    // The job's list may be longer than its step's; the step's must match its count.
    if list_var != "SLURM_JOB_NODELIST" && hosts.len() != nnodes {
        return Err(format!(
            "{list_var}={list:?} names {} host(s) but {nodes_var}={nnodes}: the environment contradicts itself",
            hosts.len()
        ));
    }
    if hosts.len() < nnodes {
        return Err(format!("{list_var}={list:?} names {} host(s), fewer than {nodes_var}={nnodes}", hosts.len()));
    }
    let (nnodes_out, node_rank, local_rank, ranks_per_host) = if req.one_rank {
        (ntasks, procid, localid, per_node)
    } else {
        if per_node != 1 {
            return Err(format!(
                "{tasks_var}={ntasks} tasks on {nodes_var}={nnodes} node(s): a launcher per node starts its node's \
                 ranks itself (--cpus/--gpus), so the step must run one task per node (srun --ntasks-per-node=1); \
                 for a task per GPU add --one-rank"
            ));
        }
        if procid != nodeid {
            return Err(format!(
                "SLURM_PROCID={procid} but SLURM_NODEID={nodeid} with one task per node: the environment \
                 contradicts itself"
            ));
        }
        (nnodes, nodeid, 0, req.ranks_per_launcher)
    };
    let (master, master_from) = if nnodes_out > 1 {
        let host = get("MASTER_ADDR");
        let port = get("MASTER_PORT");
        let port = match port {
            Some(p) => {
                HostPort::parse(&format!("x:{p}"))
                    .map_err(|_| format!("MASTER_PORT={p:?} is not a port from 1 to 65535"))?
                    .port
            }
            None => slurm_port(&job)?,
        };
        let (host, from) = match host {
            Some(h) => (h, "MASTER_ADDR".to_string()),
            None => (hosts[0].clone(), format!("the first host of {list_var}")),
        };
        let port_from = if get("MASTER_PORT").is_some() { "MASTER_PORT" } else { "the port of SLURM_JOB_ID" };
        (Some(HostPort { host, port }), format!("{from}, {port_from}"))
    } else {
        (None, String::new())
    };
    let token = (nnodes_out > 1).then(|| (format!("slurm-{job}.{step}"), format!("SLURM_JOB_ID {job}, step {step}")));
    Ok(Some(FromEnv { source, nnodes: nnodes_out, node_rank, master, master_from, local_rank, ranks_per_host, token }))
}

/// The rendezvous port of a Slurm job without `MASTER_PORT`: `15000 + job id mod 10000`.
pub fn slurm_port(job: &str) -> Result<u16, String> {
    let id: u64 = job.trim().parse().map_err(|_| {
        format!("SLURM_JOB_ID={job:?} is not a number, so no rendezvous port derives from it: set MASTER_PORT")
    })?;
    Ok(SLURM_PORT_BASE + (id % SLURM_PORT_SPAN) as u16)
}

fn torchrun(get: &dyn Fn(&str) -> Option<String>, req: Request) -> Result<FromEnv, String> {
    let world = required(get, "WORLD_SIZE", "the torchrun-style environment (RANK, LOCAL_RANK, ...) needs it")?;
    let rank = number(get, "RANK")?;
    let local_rank = number(get, "LOCAL_RANK")?;
    let local_world = number(get, "LOCAL_WORLD_SIZE")?;
    let (node_rank_of_env, group_rank) = (number(get, "NODE_RANK")?, number(get, "GROUP_RANK")?);
    if let (Some(n), Some(g)) = (node_rank_of_env, group_rank) {
        if n != g {
            return Err(format!("NODE_RANK={n} but GROUP_RANK={g}: both name this node, and they differ"));
        }
    }
    let node = node_rank_of_env.map(|n| ("NODE_RANK", n)).or(group_rank.map(|g| ("GROUP_RANK", g)));
    if world == 0 {
        return Err("WORLD_SIZE=0: a job has at least one rank".into());
    }
    if let Some(lw) = local_world {
        if lw == 0 || world % lw != 0 {
            return Err(format!(
                "WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={lw}: every node must run as many ranks"
            ));
        }
    }
    let (nnodes, node_rank, local, ranks_per_host) = if req.one_rank {
        let rank = rank.ok_or("RANK is not set, but --one-rank takes this process's rank from it")?;
        let local = local_rank.ok_or("LOCAL_RANK is not set, but --one-rank takes this rank's GPU from it")?;
        if rank >= world {
            return Err(format!("RANK={rank} is not below WORLD_SIZE={world}: the environment contradicts itself"));
        }
        if let Some(lw) = local_world {
            if local >= lw {
                return Err(format!("LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={lw}"));
            }
            if let Some((var, n)) = node {
                if rank / lw != n || rank % lw != local {
                    return Err(format!(
                        "RANK={rank} is not {var}={n} × LOCAL_WORLD_SIZE={lw} + LOCAL_RANK={local}: the \
                         environment contradicts itself"
                    ));
                }
            }
        }
        (world, rank, local, local_world.unwrap_or(1))
    } else {
        let g = req.ranks_per_launcher;
        match node {
            // NODE_RANK/GROUP_RANK name the node: WORLD_SIZE counts ranks.
            Some((var, n)) => {
                if world % g != 0 {
                    return Err(format!(
                        "WORLD_SIZE={world} is not a multiple of the {g} rank(s) this launcher starts (--cpus/--gpus): \
                         with {var} set, WORLD_SIZE counts the job's ranks"
                    ));
                }
                if let Some(lw) = local_world.filter(|&lw| lw != g) {
                    return Err(format!(
                        "LOCAL_WORLD_SIZE={lw} but this launcher starts {g} rank(s) (--cpus/--gpus): give it --gpus {lw}, \
                         or run a process per rank with --one-rank"
                    ));
                }
                if local_rank.is_some_and(|l| l != 0) {
                    return Err(per_rank_env(local_rank.unwrap_or(0)));
                }
                let nnodes = world / g;
                if n >= nnodes {
                    return Err(format!(
                        "{var}={n} is not below the {nnodes} node(s) of WORLD_SIZE={world} / {g} rank(s) per node"
                    ));
                }
                (nnodes, n, 0, g)
            }
            // Only RANK: this launcher is process RANK of WORLD_SIZE, one per node (as a
            // Kubernetes PyTorchJob sets them for a pod per node).
            None => {
                let rank = rank
                    .ok_or("WORLD_SIZE is set but none of RANK, NODE_RANK, GROUP_RANK says which launcher this is")?;
                if local_rank.is_some_and(|l| l != 0) || local_world.is_some_and(|lw| lw != 1) {
                    return Err(per_rank_env(local_rank.unwrap_or(0)));
                }
                if rank >= world {
                    return Err(format!(
                        "RANK={rank} is not below WORLD_SIZE={world}: the environment contradicts itself"
                    ));
                }
                (world, rank, 0, g)
            }
        }
    };
    let (master, master_from, token) = if nnodes > 1 {
        let host = get("MASTER_ADDR")
            .ok_or("MASTER_ADDR is not set, but a job of several launchers needs the rendezvous host")?;
        let port = get("MASTER_PORT")
            .ok_or("MASTER_PORT is not set, but a job of several launchers needs the rendezvous port")?;
        let hp = HostPort::parse(&format!("{host}:{port}")).map_err(|e| format!("MASTER_ADDR/MASTER_PORT: {e}"))?;
        let token = match get("TORCHELASTIC_RUN_ID") {
            Some(id) => (format!("torchrun-{id}"), format!("TORCHELASTIC_RUN_ID {id}")),
            None => (format!("env-{hp}-{world}"), "MASTER_ADDR, MASTER_PORT and WORLD_SIZE".to_string()),
        };
        (Some(hp), "MASTER_ADDR, MASTER_PORT".to_string(), Some(token))
    } else {
        (None, String::new(), None)
    };
    Ok(FromEnv {
        source: "the torchrun-style environment (WORLD_SIZE, RANK, ...)".into(),
        nnodes,
        node_rank,
        master,
        master_from,
        local_rank: local,
        ranks_per_host,
        token,
    })
}

fn per_rank_env(local: usize) -> String {
    format!(
        "LOCAL_RANK={local} or LOCAL_WORLD_SIZE > 1: this environment starts a process per rank, but without \
         --one-rank a launcher starts its node's ranks itself; add --one-rank"
    )
}

/// The GPU of a rank whose index on its host is `local_rank`: GPU 0 when `CUDA_VISIBLE_DEVICES`
/// shows this process one GPU (Slurm's `--gpus-per-task` / `--gpu-bind` give each task its own),
/// else GPU `local_rank`.
pub fn gpu_of_local_rank(local_rank: usize, cuda_visible: Option<&str>) -> usize {
    match cuda_visible.map(|v| v.split(',').filter(|d| !d.trim().is_empty()).count()) {
        Some(1) => 0,
        _ => local_rank,
    }
}

/// Expand a Slurm host list: `node[01-04],gpu7` → node01 … node04, gpu7; zero padding is the
/// width of a range's first number; several brackets multiply (`r[1-2]n[1-2]` → r1n1, r1n2,
/// r2n1, r2n2); commas inside brackets list numbers and ranges (`gpu[01-03,07]`).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            return Err("an empty host name between commas".into());
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']').map(|c| open + c).ok_or_else(|| format!("`{item}`: `[` without `]`"))?;
            let prefix = &rest[..open];
            if prefix.contains(']') {
                return Err(format!("`{item}`: `]` without `[`"));
            }
            let numbers = expand_brackets(&rest[open + 1..close]).map_err(|e| format!("`{item}`: {e}"))?;
            if names.len().saturating_mul(numbers.len()) > MAX_HOSTS {
                return Err(format!("`{item}` names more than {MAX_HOSTS} hosts"));
            }
            names = names.iter().flat_map(|n| numbers.iter().map(move |x| format!("{n}{prefix}{x}"))).collect();
            rest = &rest[close + 1..];
        }
        if rest.contains(']') {
            return Err(format!("`{item}`: `]` without `[`"));
        }
        hosts.extend(names.into_iter().map(|n| n + rest));
        if hosts.len() > MAX_HOSTS {
            return Err(format!("the list names more than {MAX_HOSTS} hosts"));
        }
    }
    if hosts.is_empty() {
        return Err("the list names no host".into());
    }
    Ok(hosts)
}

/// Split at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced or nested brackets".into());
        }
    }
    if depth != 0 {
        return Err("`[` without `]`".into());
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// `01-03,07` → 01, 02, 03, 07.
fn expand_brackets(inner: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in inner.split(',') {
        let part = part.trim();
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match part.split_once('-') {
            None if digits(part) => out.push(part.to_string()),
            Some((lo, hi)) if digits(lo) && digits(hi) => {
                let too_long = || format!("`{part}`: the numbers are too long");
                let (a, b): (u64, u64) = (lo.parse().map_err(|_| too_long())?, hi.parse().map_err(|_| too_long())?);
                if b < a {
                    return Err(format!("`{part}` counts down"));
                }
                if b - a >= MAX_HOSTS as u64 {
                    return Err(format!("`{part}` names more than {MAX_HOSTS} hosts"));
                }
                let width = lo.len();
                out.extend((a..=b).map(|x| format!("{x:0width$}")));
            }
            _ => return Err(format!("`{part}` inside brackets is neither a number nor a range like 01-04")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| map.get(k).cloned()
    }

    /// Variables changed from a valid environment, the request, and what the error must say.
    type Case<'a> = (&'a [(&'a str, &'a str)], Request, &'a str);

    const PER_NODE: Request = Request { one_rank: false, ranks_per_launcher: 8 };
    const ONE_RANK: Request = Request { one_rank: true, ranks_per_launcher: 1 };

    #[test]
    fn node_lists_expand_as_slurm_writes_them() {
        assert_eq!(expand_nodelist("node[01-04],gpu7").unwrap(), ["node01", "node02", "node03", "node04", "gpu7"]);
        assert_eq!(expand_nodelist("gpu[8-10,07]").unwrap(), ["gpu8", "gpu9", "gpu10", "gpu07"]);
        assert_eq!(expand_nodelist("r[1-2]n[01-02]").unwrap(), ["r1n01", "r1n02", "r2n01", "r2n02"]);
        assert_eq!(expand_nodelist("a[1-2]-ib,b").unwrap(), ["a1-ib", "a2-ib", "b"]);
        assert_eq!(expand_nodelist("localhost").unwrap(), ["localhost"]);
        assert_eq!(expand_nodelist("127.0.0.1,localhost").unwrap(), ["127.0.0.1", "localhost"]);
        assert_eq!(expand_nodelist("n[098-101]").unwrap(), ["n098", "n099", "n100", "n101"]);
        for bad in ["", "a,,b", "n[1-", "n1]", "n[3-1]", "n[a-b]", "n[1-2", "n[[1]]", "n[0-99999999999]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?}");
        }
    }

    fn slurm_step(procid: &str, localid: &str, nodeid: &str, ntasks: &str) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_JOB_ID", "4242".into()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_PROCID", procid.into()),
            ("SLURM_LOCALID", localid.into()),
            ("SLURM_NODEID", nodeid.into()),
            ("SLURM_NTASKS", ntasks.into()),
            ("SLURM_NNODES", "2".into()),
            ("SLURM_JOB_NODELIST", "gpu[07-08]".into()),
        ]
    }

    fn with(base: &[(&'static str, String)], extra: &[(&'static str, &str)]) -> impl Fn(&str) -> Option<String> {
        let mut map: HashMap<String, String> = base.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        for (k, v) in extra {
            if v.is_empty() {
                map.remove(*k);
            } else {
                map.insert(k.to_string(), v.to_string());
            }
        }
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn slurm_per_node_and_per_task() {
        let e = resolve(&with(&slurm_step("1", "0", "1", "2"), &[]), PER_NODE).unwrap().unwrap();
        assert_eq!((e.nnodes, e.node_rank, e.local_rank, e.ranks_per_host), (2, 1, 0, 8));
        assert_eq!(e.master, Some(HostPort { host: "gpu07".into(), port: 15000 + 4242 }));
        assert_eq!(e.token.as_ref().map(|t| t.0.as_str()), Some("slurm-4242.0"));
        assert!(e.master_from.contains("SLURM_JOB_NODELIST"), "{}", e.master_from);

        let e = resolve(&with(&slurm_step("11", "3", "1", "16"), &[]), ONE_RANK).unwrap().unwrap();
        assert_eq!((e.nnodes, e.node_rank, e.local_rank, e.ranks_per_host), (16, 11, 3, 8));
        // MASTER_ADDR / MASTER_PORT choose the rendezvous; the step's list wins over the job's.
        let step_list = [("SLURM_STEP_NODELIST", "n[1-2]"), ("SLURM_STEP_NUM_NODES", "2"), ("MASTER_PORT", "29500")];
        let e = resolve(&with(&slurm_step("0", "0", "0", "2"), &step_list), PER_NODE).unwrap().unwrap();
        assert_eq!(e.master, Some(HostPort { host: "n1".into(), port: 29500 }));
        let e = resolve(&with(&slurm_step("0", "0", "0", "2"), &[("MASTER_ADDR", "10.1.2.3")]), PER_NODE);
        assert_eq!(e.unwrap().unwrap().master.map(|m| m.host), Some("10.1.2.3".into()));
        // A step of one task on one node: no rendezvous needed, no token derived.
        let one = [("SLURM_NNODES", "1"), ("SLURM_JOB_NODELIST", "gpu07")];
        let e = resolve(&with(&slurm_step("0", "0", "0", "1"), &one), PER_NODE).unwrap().unwrap();
        assert_eq!((e.nnodes, e.master.clone(), e.token.clone()), (1, None, None));
    }

    #[test]
    fn slurm_contradictions_name_the_variable() {
        let cases: [Case; 9] = [
            (&[("SLURM_NTASKS", "3")], ONE_RANK, "SLURM_NTASKS=3 is not a multiple of SLURM_NNODES=2"),
            (&[("SLURM_NTASKS", "16")], PER_NODE, "add --one-rank"),
            (&[("SLURM_PROCID", "")], PER_NODE, "SLURM_PROCID is not set"),
            (&[("SLURM_PROCID", "2")], PER_NODE, "SLURM_PROCID=2 is not below SLURM_NTASKS=2"),
            (&[("SLURM_NODEID", "0")], PER_NODE, "SLURM_PROCID=1 but SLURM_NODEID=0"),
            (&[("SLURM_JOB_NODELIST", "gpu07")], PER_NODE, "fewer than SLURM_NNODES=2"),
            (&[("SLURM_STEP_NODELIST", "a,b,c")], PER_NODE, "SLURM_STEP_NODELIST=\"a,b,c\" names 3 host(s)"),
            (&[("SLURM_STEP_ID", "")], PER_NODE, "SLURM_STEP_ID is not set"),
            (&[("MASTER_PORT", "70000")], PER_NODE, "MASTER_PORT=\"70000\""),
        ];
        for (extra, req, needle) in cases {
            let e = resolve(&with(&slurm_step("1", "0", "1", "2"), extra), req).unwrap_err();
            assert!(e.contains(needle), "{extra:?}: `{needle}` missing in {e}");
        }
        let e = resolve(&with(&slurm_step("1", "1", "1", "2"), &[]), ONE_RANK).unwrap_err();
        assert!(e.contains("SLURM_LOCALID=1 is not below the 1 task(s) per node"), "{e}");
        // The batch script of a one-node job is a plain launch; --one-rank there is refused.
        let batch = env(&[("SLURM_JOB_ID", "9"), ("SLURM_NNODES", "1")]);
        assert_eq!(resolve(&batch, PER_NODE).unwrap(), None);
        assert!(resolve(&batch, ONE_RANK).unwrap_err().contains("srun"));
        assert!(slurm_port("abc").unwrap_err().contains("MASTER_PORT"));
        assert_eq!(slurm_port("123456").unwrap(), 15000 + 3456);
    }

    #[test]
    fn torchrun_style_per_rank_and_per_node() {
        let base = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "16")];
        let rank = [&base[..], &[("RANK", "11"), ("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "8"), ("GROUP_RANK", "1")]]
            .concat();
        let e = resolve(&env(&rank), ONE_RANK).unwrap().unwrap();
        assert_eq!((e.nnodes, e.node_rank, e.local_rank, e.ranks_per_host), (16, 11, 3, 8));
        assert_eq!(e.master, Some(HostPort { host: "10.0.0.1".into(), port: 29500 }));
        assert_eq!(e.token.map(|t| t.0), Some("env-10.0.0.1:29500-16".into()));
        // NODE_RANK names the node: WORLD_SIZE counts ranks.
        let node = [&base[..], &[("NODE_RANK", "1")]].concat();
        let e = resolve(&env(&node), PER_NODE).unwrap().unwrap();
        assert_eq!((e.nnodes, e.node_rank), (2, 1));
        // Only RANK (a pod per node): WORLD_SIZE counts launchers.
        let pods = [("MASTER_ADDR", "head"), ("MASTER_PORT", "23456"), ("WORLD_SIZE", "4"), ("RANK", "3")];
        let e = resolve(&env(&pods), PER_NODE).unwrap().unwrap();
        assert_eq!((e.nnodes, e.node_rank), (4, 3));
        let with_id = [&pods[..], &[("TORCHELASTIC_RUN_ID", "abc123")]].concat();
        assert_eq!(
            resolve(&env(&with_id), PER_NODE).unwrap().unwrap().token.map(|t| t.0),
            Some("torchrun-abc123".into())
        );
    }

    #[test]
    fn torchrun_contradictions_name_the_variable() {
        let base = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "16")];
        let cases: [Case; 9] = [
            (&[("RANK", "16"), ("LOCAL_RANK", "0")], ONE_RANK, "RANK=16 is not below WORLD_SIZE=16"),
            (&[("RANK", "3")], ONE_RANK, "LOCAL_RANK is not set"),
            (&[("LOCAL_RANK", "3")], ONE_RANK, "RANK is not set"),
            (
                &[("RANK", "3"), ("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "8"), ("NODE_RANK", "1")],
                ONE_RANK,
                "RANK=3 is not NODE_RANK=1",
            ),
            (&[("NODE_RANK", "1"), ("GROUP_RANK", "0")], PER_NODE, "NODE_RANK=1 but GROUP_RANK=0"),
            (&[("NODE_RANK", "2")], PER_NODE, "NODE_RANK=2 is not below the 2 node(s)"),
            (&[("NODE_RANK", "1"), ("LOCAL_WORLD_SIZE", "4")], PER_NODE, "LOCAL_WORLD_SIZE=4"),
            (&[("RANK", "1"), ("LOCAL_RANK", "1")], PER_NODE, "add --one-rank"),
            (&[("RANK", "1"), ("LOCAL_WORLD_SIZE", "5")], PER_NODE, "not a multiple of LOCAL_WORLD_SIZE=5"),
        ];
        for (extra, req, needle) in cases {
            let e = resolve(&env(&[&base[..], extra].concat()), req).unwrap_err();
            assert!(e.contains(needle), "{extra:?}: `{needle}` missing in {e}");
        }
        let no_port = [("MASTER_ADDR", "h"), ("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "0")];
        assert!(resolve(&env(&no_port), ONE_RANK).unwrap_err().contains("MASTER_PORT is not set"));
        let word = [("WORLD_SIZE", "two"), ("RANK", "1")];
        assert!(resolve(&env(&word), PER_NODE).unwrap_err().contains("WORLD_SIZE=\"two\" is not a whole number"));
        assert!(resolve(&env(&[]), ONE_RANK).unwrap_err().contains("--one-rank"));
        assert_eq!(resolve(&env(&[("MASTER_ADDR", "h")]), PER_NODE).unwrap(), None);
    }

    #[test]
    fn a_task_bound_to_one_gpu_uses_gpu_0() {
        assert_eq!(gpu_of_local_rank(3, None), 3);
        assert_eq!(gpu_of_local_rank(3, Some("5")), 0);
        assert_eq!(gpu_of_local_rank(3, Some("0,1,2,3")), 3);
        assert_eq!(HostPort::parse("[::1]:29500").unwrap(), HostPort { host: "::1".into(), port: 29500 });
        assert_eq!(HostPort::parse("gpu01:1").unwrap().to_string(), "gpu01:1");
        for bad in ["gpu01", ":80", "h:0", "h:x", "h:65536"] {
            assert!(HostPort::parse(bad).is_err(), "{bad}");
        }
    }
}

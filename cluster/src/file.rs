//! The cluster file: the one description of a VM's nodes that every host reads, and the
//! strings in it and around it (protocol, ordering, durations, a launcher's rank).

use crate::{ClusterSpec, NodeAddr, DEFAULT_PAGE_HOLD, DEFAULT_POLL_WINDOW, MAX_LINK_DELAY};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file as written. The `vm` section is the caller's type: node processes lay their
/// own flags over it, and only they know those flags.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile<V> {
    #[serde(default)]
    vm: V,
    /// `vmp` (default) or `ivy`.
    protocol: Option<String>,
    /// `tso` (default) or `paper` (unsafe for x86 guests).
    ordering: Option<String>,
    /// Relative to the cluster file's directory.
    secret_file: PathBuf,
    #[serde(default)]
    io_node: u16,
    /// One-way delay on every frame a node sends, as `--link-delay` (e.g. "100us").
    link_delay: Option<String>,
    /// As `--fetch-poll` (e.g. "200us", "0us").
    fetch_poll: Option<String>,
    /// As `--page-hold` (e.g. "500us", "0us").
    page_hold: Option<String>,
    nodes: Vec<RawNode>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    address: String,
    vcpus: Vec<u8>,
}

/// What a cluster file describes, with its `vm` section (`V`) left for the caller to finish,
/// since flags given to the node go over it.
#[derive(Debug)]
pub struct ClusterFile<V> {
    pub vm: V,
    pub spec: ClusterSpec,
    /// Zero when the file names none.
    pub link_delay: Duration,
    /// [`DEFAULT_POLL_WINDOW`] when the file names none.
    pub fetch_poll: Duration,
    /// [`DEFAULT_PAGE_HOLD`] when the file names none.
    pub page_hold: Duration,
}

/// A cluster file that cannot be read or is not valid; says which file, so the caller only
/// adds how it was given (e.g. the flag).
#[derive(Debug, thiserror::Error)]
#[error("{}: {fault}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    #[source]
    pub fault: FileFault,
}

/// What is wrong with a cluster file; names the field (`nodes[1].address`) where one is at
/// fault.
#[derive(Debug, thiserror::Error)]
pub enum FileFault {
    #[error(transparent)]
    Read(std::io::Error),
    #[error("invalid cluster file: {}: {}", .0.path(), .0.inner())]
    Invalid(#[source] serde_path_to_error::Error<serde_json::Error>),
    #[error(transparent)]
    Name(#[from] NameError),
    #[error("{field} {value:?}: {source}")]
    Duration {
        field: &'static str,
        value: String,
        source: DurationError,
    },
    #[error("secret_file {}: {source}", path.display())]
    Secret {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nodes[{index}].address {value:?}: {source} (expected IP:PORT)")]
    Address {
        index: usize,
        value: String,
        source: std::net::AddrParseError,
    },
}

/// A protocol or ordering name that is not one; `why` is what dsm's parser says is accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {value:?}: {why}")]
pub struct NameError {
    pub flag: String,
    pub value: String,
    pub why: String,
}

/// A duration that is not one [`parse_duration`] takes; says what would be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "expected a number and a unit (ns, us, ms or s), e.g. 100us or 2ms, at most {:?}",
    MAX_LINK_DELAY
)]
pub struct DurationError;

/// A file of the cluster [`write_cluster`] could not write.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}: {source}", path.display())]
pub struct WriteError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// No secret could be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot read a secret from /dev/urandom: {0}")]
pub struct SecretError(#[source] pub std::io::Error);

/// No node id could be taken from a launcher's variables.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankError {
    #[error("{name}={value:?}: not a rank (a whole number from 0 to 65535)")]
    NotARank { name: &'static str, value: String },
    #[error(
        "no --id, and none of {} is set: give --id K, or start the nodes with a launcher \
         (mpirun, srun) that sets one",
        RANK_VARIABLES.join(", ")
    )]
    Unset,
    #[error(
        "{first}={rank} and {other}={other_rank} disagree, so which node this is is unclear; \
         give --id K"
    )]
    Disagree {
        first: &'static str,
        rank: u16,
        other: &'static str,
        other_rank: u16,
    },
}

impl<V: DeserializeOwned + Default> ClusterFile<V> {
    /// Reads the cluster file at `path` and the secret file it names.
    pub fn read(path: &Path) -> Result<ClusterFile<V>, FileError> {
        let at = |fault: FileFault| FileError {
            path: path.to_path_buf(),
            fault,
        };
        let text = std::fs::read_to_string(path).map_err(|e| at(FileFault::Read(e)))?;
        let json = &mut serde_json::Deserializer::from_str(&text);
        let file: RawFile<V> =
            serde_path_to_error::deserialize(json).map_err(|e| at(FileFault::Invalid(e)))?;
        let protocol = parse_protocol("protocol", file.protocol.as_deref().unwrap_or("vmp"))
            .map_err(|e| at(e.into()))?;
        let ordering = parse_ordering("ordering", file.ordering.as_deref().unwrap_or("tso"))
            .map_err(|e| at(e.into()))?;
        let duration = |field: &'static str, value: &Option<String>, default: Duration| {
            let Some(d) = value else {
                return Ok(default);
            };
            parse_duration(d).map_err(|source| {
                at(FileFault::Duration {
                    field,
                    value: d.clone(),
                    source,
                })
            })
        };
        let link_delay = duration("link_delay", &file.link_delay, Duration::ZERO)?;
        let fetch_poll = duration("fetch_poll", &file.fetch_poll, DEFAULT_POLL_WINDOW)?;
        let page_hold = duration("page_hold", &file.page_hold, DEFAULT_PAGE_HOLD)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let secret_path = dir.join(&file.secret_file);
        let secret = std::fs::read(&secret_path).map_err(|source| {
            at(FileFault::Secret {
                path: secret_path.clone(),
                source,
            })
        })?;
        let nodes = file
            .nodes
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                let address: SocketAddr = n.address.parse().map_err(|source| {
                    at(FileFault::Address {
                        index: i,
                        value: n.address.clone(),
                        source,
                    })
                })?;
                Ok(NodeAddr {
                    address,
                    vcpus: n.vcpus,
                })
            })
            .collect::<Result<Vec<_>, FileError>>()?;
        let spec = ClusterSpec {
            nodes,
            protocol,
            ordering,
            io_node: file.io_node,
            secret,
        };
        Ok(ClusterFile {
            vm: file.vm,
            spec,
            link_delay,
            fetch_poll,
            page_hold,
        })
    }
}

/// The timings a cluster file may set for its nodes, each left to the nodes' default when
/// not given. They change how fast the VM runs, never what its guest can observe.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// `--link-delay`.
    pub link_delay: Option<Duration>,
    /// `--fetch-poll`.
    pub fetch_poll: Option<Duration>,
    /// `--page-hold`.
    pub page_hold: Option<Duration>,
}

/// 32 bytes from /dev/urandom: a secret no other VM's nodes can know.
pub fn fresh_secret() -> Result<Vec<u8>, SecretError> {
    use std::io::Read;
    let mut secret = vec![0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(SecretError)?;
    Ok(secret)
}

/// Writes `dir/cluster.json` for `spec`, with no `vm` section, and its secret beside it in
/// `dir/secret`, readable by this user only; returns the cluster file's path. The secret
/// file must not exist yet, so a secret is never written where another user made a file.
/// The timings in `timing` are written only when given, so the nodes' defaults apply
/// otherwise.
pub fn write_cluster(
    dir: &Path,
    spec: &ClusterSpec,
    timing: &Timing,
) -> Result<PathBuf, WriteError> {
    use std::os::unix::fs::OpenOptionsExt;
    let secret_path = dir.join("secret");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&secret_path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &spec.secret))
        .map_err(|source| WriteError {
            path: secret_path.clone(),
            source,
        })?;
    let mut json = serde_json::json!({
        "protocol": spec.protocol.name(),
        "ordering": spec.ordering.name(),
        "secret_file": "secret",
        "io_node": spec.io_node,
        "nodes": spec.nodes.iter().map(|nd| serde_json::json!({
            "address": nd.address.to_string(),
            "vcpus": nd.vcpus,
        })).collect::<Vec<_>>(),
    });
    for (key, d) in [
        ("link_delay", timing.link_delay),
        ("fetch_poll", timing.fetch_poll),
        ("page_hold", timing.page_hold),
    ] {
        if let Some(d) = d {
            json[key] = serde_json::json!(format!("{}ns", d.as_nanos()));
        }
    }
    let path = dir.join("cluster.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|source| WriteError {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// A protocol's name as the cluster file and `--protocol` give it; `flag` names where it
/// came from in the error.
pub fn parse_protocol(flag: &str, s: &str) -> Result<dsm::Protocol, NameError> {
    s.parse().map_err(|why| name_error(flag, s, why))
}

fn name_error(flag: &str, value: &str, why: String) -> NameError {
    NameError {
        flag: flag.to_string(),
        value: value.to_string(),
        why,
    }
}

/// An ordering's name as the cluster file and `--ordering` give it; `flag` names where it
/// came from in the error, which warns that `paper` is unsafe for x86 guests.
pub fn parse_ordering(flag: &str, s: &str) -> Result<dsm::Ordering, NameError> {
    s.parse().map_err(|why| name_error(flag, s, why))
}

/// A link delay or poll window: a non-negative number and a unit (`ns`, `us` or `µs`, `ms`,
/// `s`), at most [`MAX_LINK_DELAY`]. The error says what would be accepted; the
/// caller names the flag or field.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or(DurationError)?;
    let (number, unit) = t.split_at(split);
    let ns_per = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return Err(DurationError),
    };
    let v: f64 = number.parse().map_err(|_| DurationError)?;
    let ns = v * ns_per;
    if !ns.is_finite() || ns > MAX_LINK_DELAY.as_nanos() as f64 {
        return Err(DurationError);
    }
    Ok(Duration::from_nanos(ns.round() as u64))
}

/// The variables a launcher sets to each process's rank, in the order they are read:
/// OpenMPI's `mpirun`, MPICH's and Intel MPI's (PMI), Slurm's `srun`.
pub const RANK_VARIABLES: [&str; 3] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];

/// This node's id when `--id` is not given: the rank a launcher (`mpirun`, `srun`) gave the
/// process, from the first of [`RANK_VARIABLES`] that `var` finds set, with that variable's
/// name. Two variables that disagree, or a value that is not a rank, are refused by name.
pub fn rank_from_launcher(
    var: impl Fn(&str) -> Option<String>,
) -> Result<(u16, &'static str), RankError> {
    let mut found: Vec<(&'static str, u16)> = Vec::new();
    for name in RANK_VARIABLES {
        if let Some(value) = var(name) {
            let rank = value
                .trim()
                .parse::<u16>()
                .map_err(|_| RankError::NotARank { name, value })?;
            found.push((name, rank));
        }
    }
    let Some(&(first, rank)) = found.first() else {
        return Err(RankError::Unset);
    };
    if let Some(&(other, other_rank)) = found.iter().find(|(_, r)| *r != rank) {
        return Err(RankError::Disagree {
            first,
            rank,
            other,
            other_rank,
        });
    }
    Ok((rank, first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_rank_comes_from_the_first_launcher_variable_set_and_others_must_agree() {
        assert_eq!(
            rank_from_launcher(env(&[("OMPI_COMM_WORLD_RANK", "2")])),
            Ok((2, "OMPI_COMM_WORLD_RANK"))
        );
        assert_eq!(
            rank_from_launcher(env(&[("SLURM_PROCID", "1"), ("PMI_RANK", "1")])),
            Ok((1, "PMI_RANK"))
        );
        assert_eq!(
            rank_from_launcher(env(&[("SLURM_PROCID", "0")])),
            Ok((0, "SLURM_PROCID"))
        );
        let e = rank_from_launcher(env(&[("OMPI_COMM_WORLD_RANK", "1"), ("SLURM_PROCID", "2")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OMPI_COMM_WORLD_RANK=1 and SLURM_PROCID=2 disagree"),
            "{e}"
        );
        let e = rank_from_launcher(env(&[("PMI_RANK", "-1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("PMI_RANK=\"-1\": not a rank"), "{e}");
        let e = rank_from_launcher(env(&[])).unwrap_err().to_string();
        assert!(
            e.contains("no --id") && e.contains("OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID"),
            "{e}"
        );
    }

    #[test]
    fn link_delays_parse_with_their_unit() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("100us"), Duration::from_micros(100));
        assert_eq!(ok("100µs"), Duration::from_micros(100));
        assert_eq!(ok("2ms"), Duration::from_millis(2));
        assert_eq!(ok("0.5ms"), Duration::from_micros(500));
        assert_eq!(ok("250000ns"), Duration::from_micros(250));
        assert_eq!(ok("0.1s"), Duration::from_millis(100));
        assert_eq!(ok("0us"), Duration::ZERO);
        for bad in ["abc", "100", "ms", "-1ms", "1.2.3ms", "2 hours", "", "1s"] {
            let e = parse_duration(bad).unwrap_err().to_string();
            assert!(e.contains("e.g. 100us or 2ms"), "{bad:?}: {e}");
        }
    }

    fn spec() -> ClusterSpec {
        let addrs: Vec<SocketAddr> = (0..3)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 7000 + i)))
            .collect();
        ClusterSpec::round_robin(
            &addrs,
            4,
            dsm::Protocol::Ivy,
            dsm::Ordering::Paper,
            vec![9; 32],
        )
    }

    #[test]
    fn a_written_cluster_file_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let timing = Timing {
            link_delay: Some(Duration::from_micros(100)),
            page_hold: Some(Duration::from_micros(300)),
            ..Timing::default()
        };
        let path = write_cluster(dir.path(), &spec(), &timing).unwrap();
        let file = ClusterFile::<serde_json::Value>::read(&path).unwrap();
        assert_eq!(file.spec, spec());
        assert_eq!(file.vm, serde_json::Value::Null);
        assert_eq!(file.link_delay, Duration::from_micros(100));
        assert_eq!(file.fetch_poll, DEFAULT_POLL_WINDOW);
        assert_eq!(file.page_hold, Duration::from_micros(300));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("secret"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A second secret is not written over the first.
        let e = write_cluster(dir.path(), &spec(), &Timing::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot write") && e.contains("secret"), "{e}");
    }

    #[test]
    fn bad_cluster_files_are_refused_naming_the_file_and_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_cluster(dir.path(), &spec(), &Timing::default()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let read_with = |field: &str, value: serde_json::Value| {
            let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
            json[field] = value;
            std::fs::write(&path, json.to_string()).unwrap();
            ClusterFile::<serde_json::Value>::read(&path)
                .unwrap_err()
                .to_string()
        };
        let shown = path.display().to_string();
        let e = read_with(
            "nodes",
            serde_json::json!([{"address": "here", "vcpus": [0]}]),
        );
        assert!(
            e.starts_with(&format!("{shown}: nodes[0].address \"here\": ")),
            "{e}"
        );
        let e = read_with("colour", serde_json::json!("blue"));
        assert!(
            e.starts_with(&format!(
                "{shown}: invalid cluster file: colour: unknown field"
            )),
            "{e}"
        );
        let e = read_with("protocol", serde_json::json!("fast"));
        assert!(e.contains("protocol \"fast\": expected vmp or ivy"), "{e}");
        let e = read_with("secret_file", serde_json::json!("nowhere"));
        assert!(e.contains("secret_file ") && e.contains("nowhere"), "{e}");
        // The caller's `vm` section is read with the file, so its errors name the field
        // under `vm` and the line, as the rest do.
        #[derive(Deserialize, Default, Debug)]
        #[serde(deny_unknown_fields)]
        struct Vm {
            #[allow(dead_code)]
            cpus: Option<u8>,
        }
        std::fs::write(&path, text.replacen('{', r#"{"vm": {"cpus": 300},"#, 1)).unwrap();
        let e = ClusterFile::<Vm>::read(&path).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{shown}: invalid cluster file: vm.cpus: invalid value"
            )) && e.contains("at line 1 column"),
            "{e}"
        );
    }
}

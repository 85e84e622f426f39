//! Which request does what: maps a parsed request to a call on the VM and the answer Cloud
//! Hypervisor would give.

use crate::http::{Request, Response};
use crate::{ActionError, DeviceKind, VmControl, API_ROOT};
use serde_json::{json, Value};
use std::path::PathBuf;

/// What the server itself answers to GET vmm.ping.
#[derive(Clone, Debug)]
pub struct PingInfo {
    pub version: String,
    pub pid: u32,
}

impl PingInfo {
    /// This build and process. Taken when the server starts, so the API thread makes no
    /// call for it.
    pub fn current() -> Self {
        PingInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
        }
    }
}

/// CH's answer to a method an endpoint does not take (400, not 405).
fn wrong_method() -> Response {
    Response::error(400, &["Bad Request"])
}

fn bad_request(detail: &str) -> Response {
    Response::error(400, &["Bad Request", detail])
}

/// An action's answer: CH's messages, outermost first, end with the cause.
fn action(result: Result<(), ActionError>, context: &str, ok_status: u16) -> Response {
    match result {
        Ok(()) => Response::empty(ok_status),
        Err(e) => Response::error(e.status, &["Error from API", context, &e.message]),
    }
}

/// A query's answer: its JSON, or CH's messages as for an action.
fn answer(result: Result<serde_json::Value, ActionError>, context: &str) -> Response {
    match result {
        Ok(v) => Response::json(200, v.to_string()),
        Err(e) => Response::error(e.status, &["Error from API", context, &e.message]),
    }
}

/// Answers `req`, calling `vm` for whatever the path asks.
pub fn handle(req: &Request, vm: &dyn VmControl, ping: &PingInfo) -> Response {
    let Some(endpoint) = req
        .path
        .strip_prefix(API_ROOT)
        .and_then(|p| p.strip_prefix('/'))
    else {
        return Response::error(404, &["Not Found"]);
    };
    let get = req.method == "GET";
    let put = req.method == "PUT";
    // CH's actions without a body refuse one.
    let bodiless_put = put && req.body.is_empty();
    match endpoint {
        "vmm.ping" if get => Response::json(
            200,
            serde_json::json!({
                "build_version": ping.version,
                "version": ping.version,
                "pid": ping.pid,
                "features": [],
            })
            .to_string(),
        ),
        "vm.info" if get => answer(vm.info(), "The VM information could not be retrieved"),
        "vm.counters" if get => answer(vm.counters(), "The VM counters could not be retrieved"),
        "vm.create" if put && !req.body.is_empty() => {
            action(vm.create(&req.body), "The VM could not be created", 204)
        }
        "vm.create" if put => {
            bad_request("vm.create needs Cloud Hypervisor's VmConfig as its body")
        }
        "vm.boot" if bodiless_put => action(vm.boot(), "The VM could not boot", 204),
        "vm.reboot" if bodiless_put => action(vm.reboot(), "The VM could not reboot", 204),
        "vm.power-button" if bodiless_put => action(
            vm.power_button(),
            "The power button could not be pressed",
            204,
        ),
        "vm.delete" if bodiless_put => action(vm.delete(), "The VM could not be deleted", 204),
        "vm.pause" if bodiless_put => action(vm.pause(), "The VM could not be paused", 204),
        "vm.resume" if bodiless_put => action(vm.resume(), "The VM could not resume", 204),
        "vm.shutdown" if bodiless_put => action(vm.shutdown_vm(), "The VM could not shutdown", 204),
        // CH answers 200 here, unlike the VM's actions.
        "vmm.shutdown" if bodiless_put => {
            action(vm.shutdown_vmm(), "The VMM could not shutdown", 200)
        }
        "vm.snapshot" if put => match snapshot_dir(&req.body) {
            Ok(dir) => action(vm.snapshot(&dir), "The VM could not be snapshotted", 204),
            Err(r) => r,
        },
        "vm.send-migration" if put => match migration_target(&req.body) {
            Ok(m) => action(vm.send_migration(&m), "The VM could not be migrated", 204),
            Err(r) => r,
        },
        "vm.replicate" if put => match replicate_target(&req.body) {
            Ok(r) => action(vm.replicate(&r), "The VM could not be replicated", 204),
            Err(r) => r,
        },
        // Cold-plugged devices: CH answers a cold add with 204 and no body (its 200 with a
        // PciDeviceInfo is for a hot-plug, which virtio-mmio has not).
        "vm.add-disk" | "vm.add-net" | "vm.add-pmem" | "vm.add-vsock"
            if put && !req.body.is_empty() =>
        {
            let kind = match endpoint {
                "vm.add-disk" => DeviceKind::Disk,
                "vm.add-net" => DeviceKind::Net,
                "vm.add-vsock" => DeviceKind::Vsock,
                _ => DeviceKind::Pmem,
            };
            let context = format!("The {} could not be added to the VM", kind.name());
            action(vm.add_device(kind, &req.body), &context, 204)
        }
        "vm.add-disk" | "vm.add-net" | "vm.add-pmem" | "vm.add-vsock" if put => bad_request(
            &format!("{endpoint} needs Cloud Hypervisor's device config as its body"),
        ),
        "vm.remove-device" if put => match device_id(&req.body) {
            Ok(id) => action(
                vm.remove_device(&id),
                "The device could not be removed from the VM",
                204,
            ),
            Err(r) => r,
        },
        "vm.restore" if put => match restore_config(&req.body) {
            Ok(r) => action(vm.restore(&r), "The VM could not be restored", 204),
            Err(r) => r,
        },
        "vm.receive-migration" if put => match receive_config(&req.body) {
            Ok(r) => action(
                vm.receive_migration(&r),
                "The VM migration could not be received",
                204,
            ),
            Err(r) => r,
        },
        "vm.move-vcpu" if put => match move_target(&req.body) {
            Ok((vcpu, node)) => {
                action(vm.move_vcpu(vcpu, node), "The vCPU could not be moved", 204)
            }
            Err(r) => r,
        },
        "vmm.ping"
        | "vm.info"
        | "vm.counters"
        | "vm.pause"
        | "vm.resume"
        | "vm.shutdown"
        | "vmm.shutdown"
        | "vm.snapshot"
        | "vm.send-migration"
        | "vm.replicate"
        | "vm.move-vcpu"
        | "vm.create"
        | "vm.boot"
        | "vm.reboot"
        | "vm.delete"
        | "vm.add-disk"
        | "vm.add-net"
        | "vm.add-pmem"
        | "vm.add-vsock"
        | "vm.remove-device"
        | "vm.restore"
        | "vm.receive-migration"
        | "vm.power-button" => wrong_method(),
        other => match unsupported(other) {
            Some(why) => Response::error(
                500,
                &[
                    "Error from API",
                    &format!("{other} is not supported by Musubi"),
                    why,
                ],
            ),
            None => Response::error(404, &["Not Found"]),
        },
    }
}

/// Cloud Hypervisor's paths that Musubi answers with the reason it has no such thing, so a
/// client learns why rather than reading a bare 404.
fn unsupported(endpoint: &str) -> Option<&'static str> {
    Some(match endpoint {
        "vm.resize" | "vm.resize-zone" => "Musubi has no CPU or memory hot-plug",
        "vm.resize-disk" => {
            "virtio-mmio has no hot-plug, so a disk keeps its size while the VM runs"
        }
        "vm.add-device" | "vm.add-user-device" | "vm.add-vdpa" => {
            "Musubi passes no host devices through (no VFIO, vfio-user or vDPA)"
        }
        "vm.add-fs" | "vm.add-generic-vhost-user" => "Musubi has no vhost-user devices",
        "vm.balloon-stats" => "Musubi has no virtio-balloon",
        "vm.coredump" => "Musubi writes snapshots (vm.snapshot), not guest core dumps",
        "vm.nmi" => "Musubi does not inject NMIs",
        _ => return None,
    })
}

/// The id a vm.remove-device body names: `{"id": "_disk0"}`.
fn device_id(body: &[u8]) -> Result<String, Response> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(&format!("vm.remove-device body is not JSON: {e}")))?;
    match v.get("id") {
        Some(serde_json::Value::String(id)) if !id.is_empty() => Ok(id.clone()),
        Some(other) => Err(bad_request(&format!(
            "vm.remove-device id {other}: expected a device id string"
        ))),
        None => Err(bad_request(
            "vm.remove-device needs {\"id\": ...}: the id of the device to remove",
        )),
    }
}

/// The directory a vm.snapshot body names: `{"destination_url": "file:///DIR"}`, the only
/// scheme a snapshot is written to.
fn snapshot_dir(body: &[u8]) -> Result<PathBuf, Response> {
    if body.is_empty() {
        return Err(bad_request(
            "vm.snapshot needs a JSON body {\"destination_url\": \"file:///DIR\"}",
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Response::error(400, &["Failed to deserialize JSON", &e.to_string()]))?;
    let url = match value.get("destination_url") {
        Some(serde_json::Value::String(s)) => s,
        Some(_) => return Err(bad_request("destination_url must be a string")),
        None => {
            return Err(Response::error(
                400,
                &[
                    "Failed to deserialize JSON",
                    "missing field `destination_url`",
                ],
            ))
        }
    };
    match url.strip_prefix("file://") {
        Some(dir) if dir.starts_with('/') => Ok(PathBuf::from(dir)),
        _ => Err(bad_request(&format!(
            "destination_url {url:?}: a snapshot is written to file:///DIR (an absolute \
             directory), no other scheme"
        ))),
    }
}

/// The vCPU and node a vm.move-vcpu body names: `{"vcpu": N, "node": K}`.
fn move_target(body: &[u8]) -> Result<(u8, u16), Response> {
    const SHAPE: &str = "vm.move-vcpu needs a JSON body {\"vcpu\": N, \"node\": K}";
    if body.is_empty() {
        return Err(bad_request(SHAPE));
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Response::error(400, &["Failed to deserialize JSON", &e.to_string()]))?;
    let number = |name: &str, max: u64| match value.get(name) {
        Some(v) => v.as_u64().filter(|n| *n <= max).ok_or_else(|| {
            bad_request(&format!(
                "{name} {v}: expected a whole number from 0 to {max}"
            ))
        }),
        None => Err(Response::error(
            400,
            &[
                "Failed to deserialize JSON",
                &format!("missing field `{name}`"),
                SHAPE,
            ],
        )),
    };
    Ok((
        number("vcpu", 255)? as u8,
        number("node", u16::MAX as u64)? as u16,
    ))
}

/// The destination, secret and mode a vm.send-migration body names (see
/// [`crate::SendMigration`]).
fn migration_target(body: &[u8]) -> Result<crate::SendMigration, Response> {
    const SHAPE: &str = "vm.send-migration needs a JSON body {\"destination_url\": \
                         \"tcp:HOST:PORT\", \"secret_file\": \"/PATH\"} and for a pre-copy \
                         \"mode\": \"precopy\" with optional \"downtime_ms\" and \"max_rounds\"";
    if body.is_empty() {
        return Err(bad_request(SHAPE));
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Response::error(400, &["Failed to deserialize JSON", &e.to_string()]))?;
    let field = |name: &str| match value.get(name) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad_request(&format!("{name} must be a string"))),
        None => Err(Response::error(
            400,
            &[
                "Failed to deserialize JSON",
                &format!("missing field `{name}`"),
                SHAPE,
            ],
        )),
    };
    let url = field("destination_url")?;
    if !url.starts_with("tcp:") {
        return Err(bad_request(&format!(
            "destination_url {url:?}: a VM migrates to tcp:HOST:PORT, no other scheme"
        )));
    }
    let secret_file = secret_file(&value)?;
    ch_defaults(
        &value,
        &[
            (
                "local",
                &[json!(false)],
                "Musubi migrates over TCP, never by handing over memory",
            ),
            (
                "preserve_source",
                &[json!(false)],
                "the source's VM ends once the destination runs it",
            ),
            (
                "connections",
                &[json!(1)],
                "a migration is one authenticated connection",
            ),
            (
                "tls_dir",
                &[Value::Null],
                "the secret file authenticates a migration, not TLS",
            ),
            (
                "timeout_s",
                &[json!(3600)],
                "Musubi's migration has no overall timeout",
            ),
            (
                "timeout_strategy",
                &[json!("Cancel")],
                "Musubi's migration has no overall timeout",
            ),
        ],
    )?;
    let number = |name: &str, min: u64, max: u64| match value.get(name) {
        None => Ok(None),
        Some(v) => match v.as_u64().filter(|n| (min..=max).contains(n)) {
            Some(n) => Ok(Some(n)),
            None => Err(bad_request(&format!(
                "{name} {v}: expected a whole number from {min} to {max}"
            ))),
        },
    };
    let downtime_ms = number("downtime_ms", 0, 3_600_000)?;
    let max_rounds = number("max_rounds", 1, 1000)?;
    let push_limit = number("push_limit", 4096, u64::MAX)?;
    // Musubi's "mode", or Cloud Hypervisor's "memory_mode", whose clients always send a
    // downtime_ms (300) even for a post-copy, which then has no use for it.
    let (mode, from_ch) = match (value.get("mode"), value.get("memory_mode")) {
        (None, None) => ("postcopy".to_string(), false),
        (Some(m), None) => (m.as_str().unwrap_or("?").to_string(), false),
        (None, Some(m)) => (m.as_str().unwrap_or("?").to_ascii_lowercase(), true),
        (Some(m), Some(c)) => {
            return Err(bad_request(&format!(
                "mode {m} and memory_mode {c}: give one of them"
            )))
        }
    };
    let precopy = match mode.as_str() {
        "postcopy" => {
            let stray = if from_ch {
                max_rounds.map(|_| "max_rounds").or(downtime_ms
                    .filter(|&d| d != crate::PreCopy::DEFAULT_DOWNTIME_MS)
                    .map(|_| "downtime_ms"))
            } else {
                ["downtime_ms", "max_rounds"]
                    .into_iter()
                    .find(|n| value.get(*n).is_some())
            };
            if let Some(name) = stray {
                return Err(bad_request(&format!(
                    "{name} bounds a pre-copy; give \"mode\": \"precopy\" with it (a \
                     post-copy switches at once)"
                )));
            }
            None
        }
        "precopy" if push_limit.is_some() => {
            return Err(bad_request(
                "push_limit bounds a post-copy's background push; a pre-copy pushes nothing \
                 after the switch",
            ))
        }
        "precopy" => Some(crate::PreCopy {
            downtime_ms: downtime_ms.unwrap_or(crate::PreCopy::DEFAULT_DOWNTIME_MS),
            max_rounds: max_rounds.map_or(crate::PreCopy::DEFAULT_MAX_ROUNDS, |n| n as u32),
        }),
        _ => {
            let (name, given) = if from_ch {
                ("memory_mode", &value["memory_mode"])
            } else {
                ("mode", &value["mode"])
            };
            return Err(bad_request(&format!(
                "{name} {given}: expected \"postcopy\" or \"precopy\""
            )));
        }
    };
    Ok(crate::SendMigration {
        url,
        secret_file,
        precopy,
        push_limit,
    })
}

/// The standby, secret, epoch and policy a vm.replicate body names (see
/// [`crate::Replicate`]).
fn replicate_target(body: &[u8]) -> Result<crate::Replicate, Response> {
    const SHAPE: &str = "vm.replicate needs a JSON body {\"destination_url\": \"tcp:HOST:PORT\", \
                         \"secret_file\": \"/PATH\"} with optional \"epoch_ms\" and \"policy\" \
                         (\"go-on\" or \"stop\")";
    if body.is_empty() {
        return Err(bad_request(SHAPE));
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Response::error(400, &["Failed to deserialize JSON", &e.to_string()]))?;
    let url = match value.get("destination_url") {
        Some(Value::String(s)) if s.starts_with("tcp:") => s.clone(),
        Some(Value::String(s)) => {
            return Err(bad_request(&format!(
                "destination_url {s:?}: a standby waits at tcp:HOST:PORT, no other scheme"
            )))
        }
        Some(_) => return Err(bad_request("destination_url must be a string")),
        None => {
            return Err(Response::error(
                400,
                &[
                    "Failed to deserialize JSON",
                    "missing field `destination_url`",
                    SHAPE,
                ],
            ))
        }
    };
    let secret_file = secret_file(&value)?;
    let epoch_ms = match value.get("epoch_ms") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64().filter(|n| (1..=3_600_000).contains(n)) {
            Some(n) => Some(n),
            None => {
                return Err(bad_request(&format!(
                    "epoch_ms {v}: expected a whole number from 1 to 3600000"
                )))
            }
        },
    };
    let policy = match value.get("policy") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) if p == "go-on" || p == "stop" => Some(p.clone()),
        Some(v) => {
            return Err(bad_request(&format!(
                "policy {v}: expected \"go-on\" or \"stop\""
            )))
        }
    };
    known_fields(
        &value,
        &[
            "destination_url",
            "secret_file",
            "musubi",
            "epoch_ms",
            "policy",
        ],
    )?;
    Ok(crate::Replicate {
        url,
        secret_file,
        epoch_ms,
        policy,
    })
}

/// The secret file a migration body names, at its top level or under Musubi's extension
/// key `"musubi"`; `None` when it names none.
fn secret_file(value: &Value) -> Result<Option<PathBuf>, Response> {
    let given = value
        .get("secret_file")
        .or_else(|| value.get("musubi").and_then(|m| m.get("secret_file")));
    match given {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.starts_with('/') => Ok(Some(PathBuf::from(s))),
        Some(other) => Err(bad_request(&format!(
            "secret_file {other}: give an absolute path (the VMM runs in another directory)"
        ))),
    }
}

/// Refuses a Cloud Hypervisor field Musubi cannot honour unless it is absent or at a value
/// given (its default), naming the field, the value and why.
fn ch_defaults(value: &Value, fields: &[(&str, &[Value], &str)]) -> Result<(), Response> {
    for (name, defaults, why) in fields {
        if let Some(v) = value.get(*name) {
            if !defaults.contains(v) {
                return Err(bad_request(&format!(
                    "{name} {v}: not supported by Musubi: {why}"
                )));
            }
        }
    }
    Ok(())
}

/// A JSON body, or CH's 400 for one that is not.
fn json_body(body: &[u8], shape: &str) -> Result<Value, Response> {
    if body.is_empty() {
        return Err(bad_request(shape));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Response::error(400, &["Failed to deserialize JSON", &e.to_string()]))?;
    if !value.is_object() {
        return Err(bad_request(shape));
    }
    Ok(value)
}

/// The fields Cloud Hypervisor sends for devices Musubi has not (VFIO, NUMA zones) and
/// that ch-remote fills in at their defaults.
const NO_VFIO: &str = "Musubi has no VFIO devices or NUMA memory zones";

/// A vm.restore body: Cloud Hypervisor's RestoreConfig (see [`crate::Restore`]).
fn restore_config(body: &[u8]) -> Result<crate::Restore, Response> {
    const SHAPE: &str = "vm.restore needs a JSON body {\"source_url\": \"file:///DIR\"}";
    let value = json_body(body, SHAPE)?;
    let url = match value.get("source_url") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(bad_request(&format!(
                "source_url {other}: expected a string"
            )))
        }
        None => {
            return Err(Response::error(
                400,
                &[
                    "Failed to deserialize JSON",
                    "missing field `source_url`",
                    SHAPE,
                ],
            ))
        }
    };
    let dir = match url.strip_prefix("file://") {
        Some(dir) if dir.starts_with('/') => PathBuf::from(dir),
        _ => {
            return Err(bad_request(&format!(
                "source_url {url:?}: a snapshot is read from file:///DIR (an absolute \
                 directory), no other scheme"
            )))
        }
    };
    let flag = |name: &str| match value.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(bad_request(&format!(
            "{name} {other}: expected true or false"
        ))),
    };
    let on_demand = match value.get("memory_restore_mode") {
        None | Some(Value::Null) => false,
        Some(Value::String(m)) if m.eq_ignore_ascii_case("copy") => false,
        Some(Value::String(m)) if m.eq_ignore_ascii_case("ondemand") => true,
        Some(other) => {
            return Err(bad_request(&format!(
                "memory_restore_mode {other}: expected \"Copy\" or \"OnDemand\""
            )))
        }
    };
    ch_defaults(
        &value,
        &[
            (
                "net_fds",
                &[Value::Null],
                "a restored VM reopens the TAPs its snapshot names",
            ),
            ("vfio_fds", &[Value::Null], NO_VFIO),
            ("iommufd_fd", &[Value::Null], NO_VFIO),
            ("zone_updates", &[Value::Null, json!([])], NO_VFIO),
        ],
    )?;
    known_fields(
        &value,
        &[
            "source_url",
            "prefault",
            "memory_restore_mode",
            "resume",
            "net_fds",
            "vfio_fds",
            "iommufd_fd",
            "zone_updates",
        ],
    )?;
    Ok(crate::Restore {
        dir,
        prefault: flag("prefault")?,
        on_demand,
        resume: flag("resume")?,
    })
}

/// A vm.receive-migration body: `{"receiver_url": "tcp:HOST:PORT"}` and the secret file
/// (see [`crate::ReceiveMigration`]).
fn receive_config(body: &[u8]) -> Result<crate::ReceiveMigration, Response> {
    const SHAPE: &str =
        "vm.receive-migration needs a JSON body {\"receiver_url\": \"tcp:HOST:PORT\"}";
    let value = json_body(body, SHAPE)?;
    let url = match value.get("receiver_url") {
        Some(Value::String(s)) if s.starts_with("tcp:") => s.clone(),
        Some(other) => {
            return Err(bad_request(&format!(
                "receiver_url {other}: a VM is received on tcp:HOST:PORT, no other scheme"
            )))
        }
        None => {
            return Err(Response::error(
                400,
                &[
                    "Failed to deserialize JSON",
                    "missing field `receiver_url`",
                    SHAPE,
                ],
            ))
        }
    };
    ch_defaults(
        &value,
        &[
            (
                "tls_dir",
                &[Value::Null],
                "the secret file authenticates a migration, not TLS",
            ),
            (
                "memory_mode",
                &[Value::Null, json!("Precopy"), json!("Postcopy")],
                "the sender chooses pre-copy or post-copy",
            ),
            ("vfio_fds", &[Value::Null], NO_VFIO),
            ("iommufd_fd", &[Value::Null], NO_VFIO),
            ("zone_updates", &[Value::Null, json!([])], NO_VFIO),
        ],
    )?;
    known_fields(
        &value,
        &[
            "receiver_url",
            "secret_file",
            "musubi",
            "tls_dir",
            "memory_mode",
            "vfio_fds",
            "iommufd_fd",
            "zone_updates",
        ],
    )?;
    Ok(crate::ReceiveMigration {
        url,
        secret_file: secret_file(&value)?,
    })
}

/// Refuses a field nobody reads, so nothing asked for is silently dropped.
fn known_fields(value: &Value, known: &[&str]) -> Result<(), Response> {
    let unknown = value
        .as_object()
        .and_then(|o| o.keys().find(|k| !known.contains(&k.as_str())));
    match unknown {
        Some(k) => Err(bad_request(&format!("{k}: unknown field"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PreCopy, SendMigration};

    #[test]
    fn a_replication_names_a_tcp_standby_and_bounded_epoch_and_a_known_policy() {
        let r = |b: &str| replicate_target(b.as_bytes()).map_err(|r| format!("{r:?}"));
        assert_eq!(
            r(
                r#"{"destination_url": "tcp:h:1", "secret_file": "/s", "epoch_ms": 5, "policy": "stop"}"#
            ),
            Ok(crate::Replicate {
                url: "tcp:h:1".into(),
                secret_file: Some("/s".into()),
                epoch_ms: Some(5),
                policy: Some("stop".into()),
            })
        );
        assert_eq!(
            r(r#"{"destination_url": "tcp:h:1"}"#),
            Ok(crate::Replicate {
                url: "tcp:h:1".into(),
                secret_file: None,
                epoch_ms: None,
                policy: None,
            })
        );
        for (bad, says) in [
            ("", "vm.replicate needs"),
            ("{}", "destination_url"),
            (r#"{"destination_url": "file:///x"}"#, "tcp:HOST:PORT"),
            (
                r#"{"destination_url": "tcp:h:1", "epoch_ms": 0}"#,
                "epoch_ms",
            ),
            (
                r#"{"destination_url": "tcp:h:1", "policy": "maybe"}"#,
                "policy",
            ),
            (
                r#"{"destination_url": "tcp:h:1", "secret_file": "rel"}"#,
                "absolute",
            ),
            (
                r#"{"destination_url": "tcp:h:1", "every": 3}"#,
                "every: unknown field",
            ),
        ] {
            let e = r(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_move_names_a_vcpu_and_a_node_and_nothing_else_passes() {
        let m = |b: &str| move_target(b.as_bytes()).map_err(|r| format!("{r:?}"));
        assert_eq!(m(r#"{"vcpu": 1, "node": 2}"#), Ok((1, 2)));
        for bad in [
            "",
            "{}",
            r#"{"vcpu": 1}"#,
            r#"{"node": 1}"#,
            r#"{"vcpu": 256, "node": 1}"#,
            r#"{"vcpu": -1, "node": 1}"#,
            r#"{"vcpu": "1", "node": 1}"#,
            r#"{"vcpu": 1, "node": 70000}"#,
            "not json",
        ] {
            let e = m(bad).expect_err(bad);
            assert!(e.contains("400"), "{bad}: {e}");
        }
        let e = m(r#"{"vcpu": 300, "node": 1}"#).unwrap_err();
        assert!(
            e.contains("vcpu 300: expected a whole number from 0 to 255"),
            "{e}"
        );
    }

    fn parsed(body: &str) -> Result<SendMigration, Response> {
        migration_target(body.as_bytes())
    }

    #[test]
    fn a_migration_is_post_copy_unless_the_body_asks_for_a_pre_copy() {
        let base = r#""destination_url": "tcp:127.0.0.1:6000", "secret_file": "/s""#;
        let post = parsed(&format!("{{{base}}}")).unwrap();
        assert_eq!(post.url, "tcp:127.0.0.1:6000");
        assert_eq!(post.secret_file, Some(PathBuf::from("/s")));
        assert_eq!((post.precopy, post.push_limit), (None, None));
        let limited = parsed(&format!(r#"{{{base}, "push_limit": 65536}}"#)).unwrap();
        assert_eq!(limited.push_limit, Some(65536));
        let pre = parsed(&format!(r#"{{{base}, "mode": "precopy"}}"#)).unwrap();
        assert_eq!(
            pre.precopy,
            Some(PreCopy {
                downtime_ms: 300,
                max_rounds: 10
            })
        );
        let pre = parsed(&format!(
            r#"{{{base}, "mode": "precopy", "downtime_ms": 5, "max_rounds": 3}}"#
        ))
        .unwrap();
        assert_eq!(
            pre.precopy,
            Some(PreCopy {
                downtime_ms: 5,
                max_rounds: 3
            })
        );
        for (extra, names) in [
            (r#", "mode": "fast""#, "fast"),
            (r#", "downtime_ms": 5"#, "downtime_ms bounds a pre-copy"),
            (
                r#", "mode": "postcopy", "max_rounds": 2"#,
                "max_rounds bounds",
            ),
            (r#", "mode": "precopy", "max_rounds": 0"#, "max_rounds 0"),
            (
                r#", "mode": "precopy", "downtime_ms": -1"#,
                "downtime_ms -1",
            ),
            (r#", "mode": "precopy", "downtime_ms": "5""#, "whole number"),
            (r#", "push_limit": 4095"#, "push_limit 4095"),
            (
                r#", "mode": "precopy", "push_limit": 8192"#,
                "push_limit bounds a post-copy",
            ),
        ] {
            let e = format!("{:?}", parsed(&format!("{{{base}{extra}}}")).unwrap_err());
            assert!(e.contains("400") && e.contains(names), "{extra}: {e}");
        }
    }

    /// The bodies Cloud Hypervisor's own ch-remote sends (captured from it).
    const CH_SEND: &str = r#"{"destination_url":"tcp:127.0.0.1:6000","local":false,"preserve_source":false,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Cancel","connections":1,"tls_dir":null,"memory_mode":"Precopy"}"#;
    const CH_RESTORE: &str = r#"{"source_url":"file:///tmp/snap","prefault":true,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}"#;
    const CH_RECEIVE: &str = r#"{"receiver_url":"tcp:127.0.0.1:6000","tls_dir":null,"memory_mode":"Precopy","vfio_fds":null,"iommufd_fd":null,"zone_updates":[]}"#;

    #[test]
    fn cloud_hypervisors_migration_bodies_are_read_and_what_musubi_cannot_do_is_refused() {
        let pre = parsed(CH_SEND).unwrap();
        assert_eq!(pre.secret_file, None);
        assert_eq!(
            pre.precopy,
            Some(PreCopy {
                downtime_ms: 300,
                max_rounds: 10
            })
        );
        let post = parsed(&CH_SEND.replace("Precopy", "Postcopy")).unwrap();
        assert_eq!(post.precopy, None);
        for (from, to, says) in [
            (
                r#""local":false"#,
                r#""local":true"#,
                "local true: not supported",
            ),
            (r#""connections":1"#, r#""connections":4"#, "connections 4"),
            (r#""tls_dir":null"#, r#""tls_dir":"/t""#, "tls_dir"),
            (r#""Precopy""#, r#""Fast""#, "Fast"),
        ] {
            let e = format!("{:?}", parsed(&CH_SEND.replace(from, to)).unwrap_err());
            assert!(e.contains("400") && e.contains(says), "{to}: {e}");
        }
        let r = receive_config(CH_RECEIVE.as_bytes()).unwrap();
        assert_eq!(
            (r.url.as_str(), r.secret_file),
            ("tcp:127.0.0.1:6000", None)
        );
        let with_secret = CH_RECEIVE.replace('{', r#"{"musubi":{"secret_file":"/s"},"#);
        let r = receive_config(with_secret.as_bytes()).unwrap();
        assert_eq!(r.secret_file, Some(PathBuf::from("/s")));
        for (from, to, says) in [
            ("tcp:127", "unix:/x:127", "no other scheme"),
            (r#""tls_dir":null"#, r#""tls_dir":"/t""#, "tls_dir"),
            (
                "\"zone_updates\":[]",
                "\"zone_updates\":[1]",
                "zone_updates [1]",
            ),
            (
                r#""memory_mode""#,
                r#""speed":1,"memory_mode""#,
                "speed: unknown field",
            ),
        ] {
            let e = format!(
                "{:?}",
                receive_config(CH_RECEIVE.replace(from, to).as_bytes())
            );
            assert!(e.contains("400") && e.contains(says), "{to}: {e}");
        }
    }

    #[test]
    fn a_restore_takes_cloud_hypervisors_restore_config() {
        let r = restore_config(CH_RESTORE.as_bytes()).unwrap();
        assert_eq!(r.dir, PathBuf::from("/tmp/snap"));
        assert!(r.prefault && !r.on_demand && !r.resume, "{r:?}");
        let lazy = CH_RESTORE
            .replace("\"Copy\"", "\"OnDemand\"")
            .replace("\"resume\":false", "\"resume\":true");
        let r = restore_config(lazy.as_bytes()).unwrap();
        assert!(r.on_demand && r.resume, "{r:?}");
        for (from, to, says) in [
            ("file:///tmp", "tcp://h/tmp", "tcp://h/tmp/snap"),
            ("file:///tmp", "file://tmp", "absolute"),
            (
                "\"net_fds\":null",
                "\"net_fds\":[\"n@3\"]",
                "reopens the TAPs",
            ),
            ("\"Copy\"", "\"Lazy\"", "Lazy"),
            ("\"prefault\":true", "\"prefault\":1", "prefault 1"),
            ("\"resume\"", "\"resumed\"", "resumed: unknown field"),
        ] {
            let e = format!(
                "{:?}",
                restore_config(CH_RESTORE.replace(from, to).as_bytes())
            );
            assert!(e.contains("400") && e.contains(says), "{to}: {e}");
        }
        let e = format!("{:?}", restore_config(b"{}"));
        assert!(e.contains("missing field `source_url`"), "{e}");
    }

    #[test]
    fn a_removal_names_one_device_id() {
        let m = |b: &str| device_id(b.as_bytes()).map_err(|r| format!("{r:?}"));
        assert_eq!(m(r#"{"id": "_disk0"}"#), Ok("_disk0".to_string()));
        for (bad, says) in [
            ("", "not JSON"),
            ("{}", "vm.remove-device needs"),
            (r#"{"id": 3}"#, "id 3: expected a device id string"),
            (r#"{"id": ""}"#, "expected a device id string"),
        ] {
            let e = m(bad).expect_err(bad);
            assert!(e.contains("400") && e.contains(says), "{bad}: {e}");
        }
    }
}

//! Which request does what: maps a parsed request to a call on the VM and the answer Cloud
//! Hypervisor would give.

use crate::http::{Request, Response};
use crate::{ActionError, DeviceKind, VmControl, API_ROOT};
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
        // Cold-plugged devices: CH answers a cold add with 204 and no body (its 200 with a
        // PciDeviceInfo is for a hot-plug, which virtio-mmio has not).
        "vm.add-disk" | "vm.add-net" | "vm.add-pmem" if put && !req.body.is_empty() => {
            let kind = match endpoint {
                "vm.add-disk" => DeviceKind::Disk,
                "vm.add-net" => DeviceKind::Net,
                _ => DeviceKind::Pmem,
            };
            let context = format!("The {} could not be added to the VM", kind.name());
            action(vm.add_device(kind, &req.body), &context, 204)
        }
        "vm.add-disk" | "vm.add-net" | "vm.add-pmem" if put => bad_request(&format!(
            "{endpoint} needs Cloud Hypervisor's device config as its body"
        )),
        "vm.remove-device" if put => match device_id(&req.body) {
            Ok(id) => action(
                vm.remove_device(&id),
                "The device could not be removed from the VM",
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
        "vmm.ping" | "vm.info" | "vm.counters" | "vm.pause" | "vm.resume" | "vm.shutdown"
        | "vmm.shutdown" | "vm.snapshot" | "vm.send-migration" | "vm.move-vcpu" | "vm.create"
        | "vm.boot" | "vm.reboot" | "vm.delete" | "vm.add-disk" | "vm.add-net" | "vm.add-pmem"
        | "vm.remove-device" | "vm.power-button" => wrong_method(),
        _ => Response::error(404, &["Not Found"]),
    }
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
    let secret = field("secret_file")?;
    if !secret.starts_with('/') {
        return Err(bad_request(&format!(
            "secret_file {secret:?}: give an absolute path (the VMM runs in another directory)"
        )));
    }
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
    let precopy = match value.get("mode").map(|m| m.as_str()) {
        None | Some(Some("postcopy")) => {
            if let Some(name) = ["downtime_ms", "max_rounds"]
                .into_iter()
                .find(|n| value.get(*n).is_some())
            {
                return Err(bad_request(&format!(
                    "{name} bounds a pre-copy; give \"mode\": \"precopy\" with it (a \
                     post-copy switches at once)"
                )));
            }
            None
        }
        Some(Some("precopy")) if push_limit.is_some() => {
            return Err(bad_request(
                "push_limit bounds a post-copy's background push; a pre-copy pushes nothing \
                 after the switch",
            ))
        }
        Some(Some("precopy")) => Some(crate::PreCopy {
            downtime_ms: downtime_ms.unwrap_or(crate::PreCopy::DEFAULT_DOWNTIME_MS),
            max_rounds: max_rounds.map_or(crate::PreCopy::DEFAULT_MAX_ROUNDS, |n| n as u32),
        }),
        Some(_) => {
            return Err(bad_request(&format!(
                "mode {}: expected \"postcopy\" or \"precopy\"",
                value["mode"]
            )))
        }
    };
    Ok(crate::SendMigration {
        url,
        secret_file: PathBuf::from(secret),
        precopy,
        push_limit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PreCopy, SendMigration};

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
        assert_eq!(post.secret_file, PathBuf::from("/s"));
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

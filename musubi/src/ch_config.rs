//! Cloud Hypervisor's VmConfig (the JSON body of its `vm.create`) read into a [`VmConfig`]:
//! every field Musubi honours is taken, every field at Cloud Hypervisor's default is
//! accepted, and anything else is refused naming the field and the value, so a client never
//! gets a VM that behaves otherwise than it asked. Musubi's own settings live under the
//! extension key `"musubi"`, which Cloud Hypervisor's clients leave alone.

use musubi_api::DeviceKind;
use musubi_types::Counters;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use vmm::config::net::{Fds, MacAddr, NetConfig, MAX_NUM_QUEUES};
use vmm::config::rng::RngConfig;
use vmm::config::vsock::VsockConfig;
use vmm::config::CacheMode;
use vmm::config::{
    check_cpus, check_memory, DiskConfig, ExitsMode, KernelImage, SerialMode, VmConfig,
};
use vmm::pmem::{Advertise, PmemConfig};

/// The extension key for Musubi's own settings.
pub const EXTENSION: &str = "musubi";

/// Why a Cloud Hypervisor VmConfig is refused; each names the field (`disks[0].vhost_user`)
/// and, where there is one, the value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChConfigError {
    #[error("{0}: not JSON: {1}")]
    Json(&'static str, String),
    #[error(
        "{0}: unknown field (not in Cloud Hypervisor's VmConfig; Musubi's own settings go \
         under \"{EXTENSION}\")"
    )]
    Unknown(String),
    #[error("{field}: missing (Cloud Hypervisor's VmConfig needs it here)")]
    Missing { field: String },
    #[error("{field} {value}: expected {expected}")]
    Type {
        field: String,
        value: String,
        expected: &'static str,
    },
    #[error("{field} {value}: not supported by Musubi: {why}")]
    Unsupported {
        field: String,
        value: String,
        why: &'static str,
    },
    #[error("{field} {id:?}: the id is used twice")]
    DuplicateId { field: String, id: String },
    #[error("id {0:?}: a device of this VM has it already; give another id or vm.remove-device it first")]
    TakenId(String),
    #[error("id {0:?}: no disk, net, pmem or vsock device of this VM has it (vm.info lists them)")]
    UnknownId(String),
    #[error("vsock: this VM has a vsock device already ({0:?}); vm.remove-device it first")]
    SecondVsock(String),
    #[error("{0}")]
    Config(#[from] vmm::config::ConfigError),
    #[error("vsock: {0}")]
    Vsock(String),
    #[error("{0}: {1}")]
    Net(String, #[source] vmm::config::net::NetError),
}

type Result<T> = std::result::Result<T, ChConfigError>;

/// A Cloud Hypervisor VmConfig as Musubi runs it: the VM to build, and the config as
/// `vm.info` shows it (defaults filled in, ids given).
#[derive(Clone, Debug)]
pub struct ChVm {
    pub config: VmConfig,
    pub info: Value,
}

/// The arrays of a VmConfig that hold cold-pluggable devices, with Cloud Hypervisor's id
/// prefixes.
const DEVICE_LISTS: [(&str, &str); 3] = [("disks", "disk"), ("net", "net"), ("pmem", "pmem")];

impl ChVm {
    /// This VM with one more device of `kind` (Cloud Hypervisor's DiskConfig, NetConfig or
    /// PmemConfig JSON in `body`), read by the same rules as the config's own devices, and
    /// the id it got: the one given, or `_disk2` and so on after the config's own.
    pub fn add_device(&self, kind: DeviceKind, body: &[u8]) -> Result<(ChVm, String)> {
        let (list, prefix) = match kind {
            DeviceKind::Disk => DEVICE_LISTS[0],
            DeviceKind::Net => DEVICE_LISTS[1],
            DeviceKind::Pmem => DEVICE_LISTS[2],
            DeviceKind::Vsock => ("vsock", "vsock"),
        };
        if kind == DeviceKind::Vsock {
            if let Some(id) = self.info["vsock"]["id"].as_str() {
                return Err(ChConfigError::SecondVsock(id.to_string()));
            }
        }
        let mut device: Value = serde_json::from_slice(body)
            .map_err(|e| ChConfigError::Json(list_name(list), e.to_string()))?;
        let Value::Object(fields) = &mut device else {
            return Err(ChConfigError::Type {
                field: list.into(),
                value: device.to_string(),
                expected: "an object",
            });
        };
        let taken = self.ids();
        let id = match fields.get("id") {
            None | Some(Value::Null) => {
                let count = self.info[list].as_array().map_or(0, Vec::len);
                (count..)
                    .map(|n| format!("_{prefix}{n}"))
                    .find(|id| !taken.contains(id))
                    .unwrap_or_default()
            }
            Some(Value::String(id)) if taken.contains(id) => {
                return Err(ChConfigError::TakenId(id.clone()))
            }
            Some(Value::String(id)) => id.clone(),
            Some(other) => {
                return Err(ChConfigError::Type {
                    field: format!("{list}.id"),
                    value: other.to_string(),
                    expected: "a string",
                })
            }
        };
        fields.insert("id".into(), json!(id));
        let mut info = self.info.clone();
        match info[list].as_array_mut() {
            _ if kind == DeviceKind::Vsock => info[list] = device,
            Some(devices) => devices.push(device),
            None => info[list] = json!([device]),
        }
        Ok((from_value(&info)?, id))
    }

    /// This VM without the device with this id.
    pub fn remove_device(&self, id: &str) -> Result<ChVm> {
        let mut info = self.info.clone();
        for (list, _) in DEVICE_LISTS {
            let Some(devices) = info[list].as_array_mut() else {
                continue;
            };
            let Some(at) = devices.iter().position(|d| d["id"] == id) else {
                continue;
            };
            devices.remove(at);
            // Musubi's pmem settings go with the config's pmem by position.
            if list == "pmem" {
                if let Some(ext) = info[EXTENSION]["pmem"].as_array_mut() {
                    if at < ext.len() {
                        ext.remove(at);
                    }
                }
            }
            return from_value(&info);
        }
        if info["vsock"]["id"] == id {
            info["vsock"] = Value::Null;
            return from_value(&info);
        }
        Err(ChConfigError::UnknownId(id.to_string()))
    }

    /// Every device id of this VM.
    fn ids(&self) -> Vec<String> {
        DEVICE_LISTS
            .iter()
            .flat_map(|(list, _)| self.info[*list].as_array().into_iter().flatten())
            .chain(Some(&self.info["vsock"]))
            .filter_map(|d| d["id"].as_str().map(String::from))
            .collect()
    }
}

/// Cloud Hypervisor's name for the body of a `vm.add-*` call.
fn list_name(list: &str) -> &'static str {
    match list {
        "disks" => "DiskConfig",
        "net" => "NetConfig",
        "vsock" => "VsockConfig",
        _ => "PmemConfig",
    }
}

/// Whether a JSON config is Cloud Hypervisor's (it has a `payload`) rather than Musubi's
/// own form.
pub fn is_ch_config(value: &Value) -> bool {
    value.get("payload").is_some()
}

/// Reads Cloud Hypervisor's VmConfig from `text`.
pub fn parse(text: &[u8]) -> Result<ChVm> {
    let value: Value =
        serde_json::from_slice(text).map_err(|e| ChConfigError::Json("VmConfig", e.to_string()))?;
    from_value(&value)
}

/// Reads Cloud Hypervisor's VmConfig from parsed JSON.
pub fn from_value(value: &Value) -> Result<ChVm> {
    read(value, true)
}

/// Cloud Hypervisor's VmConfig for a VM Musubi built from elsewhere (a snapshot, a
/// migration, `musubi run`'s flags), as a client would have written it.
pub fn describe(config: &VmConfig) -> Value {
    let (mode, file) = match &config.serial {
        SerialMode::Off => ("Off", None),
        SerialMode::Stdio => ("Tty", None),
        SerialMode::File(f) => ("File", Some(f)),
    };
    json!({
        "payload": {
            "kernel": config.kernel.name(),
            "cmdline": config.cmdline,
            "initramfs": config.initrd,
        },
        "cpus": {"boot_vcpus": config.cpus},
        "memory": {"size": config.memory},
        "disks": config.disks.iter().map(disk_json).collect::<Vec<_>>(),
        "net": config.net.iter().map(net_json).collect::<Vec<_>>(),
        "pmem": config.pmem.iter().map(pmem_json).collect::<Vec<_>>(),
        "serial": {"mode": mode, "file": file},
        "rng": config.rng.map(|_| json!({"src": "/dev/urandom"})),
        "vsock": config.vsock.as_ref().map(|v| json!({"cid": v.cid, "socket": v.socket})),
        EXTENSION: {
            "exits": config.exits.to_string(),
            "pmem": config.pmem.iter().map(|p| json!({"advertise": p.advertise.to_string()}))
                .collect::<Vec<_>>(),
            "rng": config.rng.and_then(|r| r.bytes_per_sec)
                .map(|n| json!({"bytes_per_sec": n})),
        },
    })
}

/// Cloud Hypervisor's DiskConfig for a disk given as `--disk` gives it.
pub fn disk_json(d: &DiskConfig) -> Value {
    json!({"path": d.path, "readonly": d.readonly, "direct": d.cache == CacheMode::None})
}

/// Cloud Hypervisor's NetConfig for a network device given as `--net` gives it (its rate
/// limit has no place there).
pub fn net_json(n: &NetConfig) -> Value {
    json!({
        "tap": n.tap, "ip": n.ip, "mask": n.mask, "mac": n.mac,
        "fds": n.fd.as_ref().map(|f| f.0.clone()), "num_queues": n.num_queues,
        "queue_size": n.queue_size,
    })
}

/// Cloud Hypervisor's PmemConfig for memory storage given as `--pmem` gives it (how it is
/// advertised goes under the VmConfig's extension key, which a device body has not).
pub fn pmem_json(p: &PmemConfig) -> Value {
    json!({"file": p.file, "size": p.size})
}

impl ChVm {
    /// A VM Musubi built from elsewhere (a snapshot, a migration), with the VmConfig
    /// `vm.info` shows for it. The config is kept as it is (a kernel the binary carries, a
    /// TAP descriptor); where no VmConfig can say it, `vm.info` shows the plain description.
    pub fn from_config(config: VmConfig) -> ChVm {
        let described = describe(&config);
        let info = read(&described, false).map_or(described, |vm| vm.info);
        ChVm { config, info }
    }
}

impl ChVm {
    /// Cloud Hypervisor's VmInfo for this VM in `state` (Created, Running, Paused,
    /// Shutdown): its config, RAM, and a device tree with an entry per device id.
    pub fn vm_info(&self, state: &str) -> Value {
        let mut device_tree = Map::new();
        let lists = DEVICE_LISTS.iter().map(|(list, _)| &self.info[*list]);
        let devices = lists.flat_map(|l| l.as_array().into_iter().flatten());
        for d in devices.chain(Some(&self.info["vsock"])) {
            if let Some(id) = d["id"].as_str() {
                device_tree.insert(
                    id.to_string(),
                    json!({"id": id, "resources": [], "children": [], "pci_bdf": null}),
                );
            }
        }
        json!({
            "config": self.info,
            "state": state,
            "memory_actual_size": self.config.memory,
            "device_tree": device_tree,
        })
    }
}

impl ChVm {
    /// `vm.counters` keyed as Cloud Hypervisor keys them, by device id (`_disk0`, or the id
    /// the config gave) instead of Musubi's device names (`virtio-blk0`); counters of
    /// anything without an id keep their names.
    pub fn keyed_by_id(&self, mut counters: Counters) -> Counters {
        for (list, name) in [("disks", "virtio-blk"), ("net", "virtio-net")] {
            for (i, d) in self.info[list].as_array().into_iter().flatten().enumerate() {
                let id = d["id"].as_str();
                if let (Some(id), Some(c)) = (id, counters.devices.remove(&format!("{name}{i}"))) {
                    counters.devices.insert(id.to_string(), c);
                }
            }
        }
        counters
    }
}

/// Reads a VmConfig; `check_files` asks that the kernel, initramfs and disk files exist.
/// They need not for a VM built already (a snapshot's or a migration's, which loads no
/// kernel), whose description may be read on a thread whose filter allows no file calls.
fn read(value: &Value, check_files: bool) -> Result<ChVm> {
    let mut top = Obj::new("", value)?;
    let payload = top.object("payload")?;
    let Some(payload) = payload else {
        return Err(ChConfigError::Missing {
            field: "payload".into(),
        });
    };
    let mut p = Obj::new("payload", payload)?;
    let kernel = p.path("kernel")?.ok_or(ChConfigError::Missing {
        field: "payload.kernel".into(),
    })?;
    let cmdline = p.string("cmdline")?;
    let initrd = p.path("initramfs")?;
    for key in ["firmware", "igvm", "host_data"] {
        p.default_only(key, &[Value::Null], "Musubi boots a kernel directly")?;
    }
    if check_files && !kernel.is_file() {
        return Err(ChConfigError::Type {
            field: "payload.kernel".into(),
            value: format!("{:?}", kernel.display().to_string()),
            expected: "a kernel file that exists",
        });
    }
    if let Some(i) = initrd.as_ref().filter(|_| check_files) {
        if !i.is_file() {
            return Err(ChConfigError::Type {
                field: "payload.initramfs".into(),
                value: format!("{:?}", i.display().to_string()),
                expected: "an initramfs file that exists",
            });
        }
    }
    let payload_info = p.finish()?;

    let (cpus, cpus_info) = cpus(top.object("cpus")?)?;
    let (memory, memory_info) = memory(top.object("memory")?)?;
    let mut ids = Vec::new();
    let mut disks = Vec::new();
    let mut disks_info = Vec::new();
    for (i, d) in top.array("disks")?.iter().enumerate() {
        let (disk, info) = disk(i, d, &mut ids, check_files)?;
        disks.push(disk);
        disks_info.push(info);
    }
    let mut nets = Vec::new();
    let mut nets_info = Vec::new();
    for (i, n) in top.array("net")?.iter().enumerate() {
        let (net, info) = net(i, n, &mut ids)?;
        nets.push(net);
        nets_info.push(info);
    }
    let mut pmems = Vec::new();
    let mut pmems_info = Vec::new();
    for (i, p) in top.array("pmem")?.iter().enumerate() {
        let (pmem, info) = pmem(i, p, &mut ids)?;
        pmems.push(pmem);
        pmems_info.push(info);
    }
    let (serial, serial_info) = serial(top.object("serial")?)?;
    let console_info = console(top.object("console")?)?;
    let rng_info = rng(top.object("rng")?)?;
    let (vsock, vsock_info) = match top.object("vsock")? {
        Some(v) => {
            let (config, info) = vsock(v, &mut ids, check_files)?;
            (Some(config), Some(info))
        }
        None => (None, None),
    };
    for (key, defaults) in [
        ("balloon", vec![Value::Null]),
        ("fs", vec![Value::Null, json!([])]),
        ("generic_vhost_user", vec![Value::Null, json!([])]),
        ("pci_segments", vec![Value::Null, json!([])]),
        ("rtc", vec![Value::Null]),
        ("devices", vec![Value::Null, json!([])]),
        ("user_devices", vec![Value::Null, json!([])]),
        ("vdpa", vec![Value::Null, json!([])]),
        ("numa", vec![Value::Null, json!([])]),
        ("sgx_epc", vec![Value::Null, json!([])]),
        ("rate_limit_groups", vec![Value::Null, json!([])]),
        ("tpm", vec![Value::Null]),
        ("platform", vec![Value::Null]),
        ("landlock_rules", vec![Value::Null, json!([])]),
        ("iommu", vec![json!(false)]),
        ("watchdog", vec![json!(false)]),
        ("pvpanic", vec![json!(false)]),
        ("landlock_enable", vec![json!(false)]),
        (
            "debug_console",
            vec![
                Value::Null,
                json!({"mode": "Off"}),
                json!({"mode": "Off", "iobase": 233}),
            ],
        ),
    ] {
        top.default_only(key, &defaults, "Musubi has no such device or feature")?;
    }
    let ext = extension(top.object(EXTENSION)?, pmems.len())?;
    let (exits, advertise, ext_info) = (ext.exits, ext.advertise, ext.info);
    // Musubi's rate limit goes with Cloud Hypervisor's device; alone it asks for nothing.
    let rng = match (&rng_info, ext.rng_bytes_per_sec) {
        (Some(_), bytes_per_sec) => Some(RngConfig { bytes_per_sec }),
        (None, None) => None,
        (None, Some(_)) => {
            return Err(ChConfigError::Missing {
                field: "rng (musubi.rng limits the rate of the VmConfig's rng device)".into(),
            })
        }
    };
    for (p, a) in pmems.iter_mut().zip(advertise) {
        p.advertise = a;
    }
    top.finish()?;

    let config = VmConfig {
        kernel: KernelImage::File(kernel),
        cmdline: cmdline.unwrap_or_default(),
        initrd,
        cpus,
        memory,
        disks,
        pmem: pmems,
        serial,
        exits,
        net: nets,
        rng,
        vsock,
    };
    let info = json!({
        "payload": payload_info,
        "cpus": cpus_info,
        "memory": memory_info,
        "disks": disks_info,
        "net": nets_info,
        "pmem": pmems_info,
        "serial": serial_info,
        "console": console_info,
        "rng": rng_info,
        "vsock": vsock_info,
        "iommu": false,
        "watchdog": false,
        "pvpanic": false,
        EXTENSION: ext_info,
    });
    Ok(ChVm { config, info })
}

fn cpus(v: Option<&Value>) -> Result<(u8, Value)> {
    let empty = json!({});
    let mut c = Obj::new("cpus", v.unwrap_or(&empty))?;
    let boot = c.u64("boot_vcpus")?.unwrap_or(1);
    let n = check_cpus(boot).map_err(|_| ChConfigError::Type {
        field: "cpus.boot_vcpus".into(),
        value: boot.to_string(),
        expected: "1 to 37 (what the MP table holds)",
    })?;
    let max = c.u64("max_vcpus")?.unwrap_or(boot);
    if max != boot {
        return Err(ChConfigError::Unsupported {
            field: "cpus.max_vcpus".into(),
            value: max.to_string(),
            why: "Musubi has no CPU hot-plug; give max_vcpus = boot_vcpus",
        });
    }
    const WHY: &str = "Musubi gives the guest its host's CPU model and a flat topology";
    c.default_only("topology", &[Value::Null], WHY)?;
    c.default_only(
        "kvm_hyperv",
        &[json!(false)],
        "Musubi has no Hyper-V enlightenments",
    )?;
    c.default_only("max_phys_bits", &[json!(46)], WHY)?;
    c.default_only(
        "affinity",
        &[Value::Null, json!([])],
        "Musubi does not pin vCPUs",
    )?;
    c.default_only("features", &[json!({}), json!({"amx": false})], WHY)?;
    c.default_only("nested", &[json!(true)], WHY)?;
    c.default_only(
        "core_scheduling",
        &[json!("Vm")],
        "Musubi leaves vCPU scheduling to the host",
    )?;
    let mut info = c.finish()?;
    info.insert("boot_vcpus".into(), json!(boot));
    info.insert("max_vcpus".into(), json!(boot));
    info.insert("kvm_hyperv".into(), json!(false));
    info.insert("max_phys_bits".into(), json!(46));
    Ok((n, Value::Object(info)))
}

/// Cloud Hypervisor's default guest RAM.
const CH_DEFAULT_MEMORY: u64 = 512 << 20;

fn memory(v: Option<&Value>) -> Result<(u64, Value)> {
    let empty = json!({});
    let mut m = Obj::new("memory", v.unwrap_or(&empty))?;
    let size = m.u64("size")?.unwrap_or(CH_DEFAULT_MEMORY);
    check_memory("memory.size", &size.to_string(), size)?;
    const RAM: &str = "Musubi backs guest RAM with private anonymous memory";
    m.default_only("shared", &[json!(false)], RAM)?;
    m.default_only("hugepages", &[json!(false)], RAM)?;
    m.default_only("hugepage_size", &[Value::Null], RAM)?;
    m.default_only("mergeable", &[json!(false)], RAM)?;
    m.default_only("prefault", &[json!(false)], RAM)?;
    m.default_only("thp", &[json!(true)], RAM)?;
    m.default_only("reserve", &[json!(false)], RAM)?;
    m.default_only("zones", &[Value::Null, json!([])], RAM)?;
    const HOTPLUG: &str = "Musubi has no memory hot-plug";
    m.default_only("hotplug_method", &[json!("Acpi")], HOTPLUG)?;
    m.default_only("hotplug_size", &[Value::Null, json!(0)], HOTPLUG)?;
    m.default_only("hotplugged_size", &[Value::Null, json!(0)], HOTPLUG)?;
    let mut info = m.finish()?;
    for (k, v) in [
        ("size", json!(size)),
        ("mergeable", json!(false)),
        ("shared", json!(false)),
        ("hugepages", json!(false)),
        ("prefault", json!(false)),
        ("thp", json!(true)),
        ("hotplug_method", json!("Acpi")),
    ] {
        info.insert(k.into(), v);
    }
    Ok((size, Value::Object(info)))
}

/// The id a device is known by: the one given, or Cloud Hypervisor's `_<kind>N`; refused
/// when another device has it.
fn device_id(o: &mut Obj, kind: &str, index: usize, ids: &mut Vec<String>) -> Result<String> {
    let id = o.string("id")?.unwrap_or_else(|| format!("_{kind}{index}"));
    if ids.contains(&id) {
        return Err(ChConfigError::DuplicateId {
            field: format!("{}.id", o.path),
            id,
        });
    }
    ids.push(id.clone());
    Ok(id)
}

const VIRTIO_MMIO: &str = "Musubi's devices are virtio-mmio, with no IOMMU or PCI segments";

fn disk(
    i: usize,
    v: &Value,
    ids: &mut Vec<String>,
    check_file: bool,
) -> Result<(DiskConfig, Value)> {
    let mut d = Obj::new(&format!("disks[{i}]"), v)?;
    let path = d.path("path")?.ok_or_else(|| ChConfigError::Missing {
        field: format!("disks[{i}].path"),
    })?;
    if check_file {
        vmm::config::check_storage_file("disks[].path", &path)?;
    }
    let readonly = d.bool("readonly")?.unwrap_or(false);
    let direct = d.bool("direct")?.unwrap_or(false);
    d.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    d.default_only("pci_segment", &[json!(0)], VIRTIO_MMIO)?;
    d.default_only(
        "num_queues",
        &[json!(1)],
        "Musubi's virtio-blk has one queue",
    )?;
    d.default_only(
        "queue_size",
        &[json!(128)],
        "Musubi's virtio-blk queue size is fixed",
    )?;
    const VHOST: &str = "Musubi serves its disks itself (no vhost-user)";
    d.default_only("vhost_user", &[json!(false)], VHOST)?;
    d.default_only("vhost_socket", &[Value::Null], VHOST)?;
    const LIMIT: &str = "Musubi's disks have no rate limiter";
    d.default_only("rate_limiter_config", &[Value::Null], LIMIT)?;
    d.default_only("rate_limit_group", &[Value::Null], LIMIT)?;
    d.default_only(
        "serial",
        &[Value::Null],
        "Musubi's disks have no serial number",
    )?;
    d.default_only(
        "queue_affinity",
        &[Value::Null],
        "Musubi does not pin queues",
    )?;
    const IO: &str = "Musubi's disk I/O path is its own";
    d.default_only("disable_io_uring", &[json!(false)], IO)?;
    d.default_only("disable_aio", &[json!(false)], IO)?;
    d.default_only("sparse", &[json!(true)], IO)?;
    d.default_only(
        "image_type",
        &[json!("Unknown"), json!("Raw")],
        "Musubi's disks are raw images",
    )?;
    d.default_only(
        "backing_files",
        &[json!(false)],
        "Musubi's disks are raw images, with no backing files",
    )?;
    d.default_only(
        "lock_granularity",
        &[json!("ByteRange")],
        "Musubi's disk image locking is its own",
    )?;
    d.default_only("pci_device_id", &[Value::Null], VIRTIO_MMIO)?;
    let id = device_id(&mut d, "disk", i, ids)?;
    let mut info = d.finish()?;
    for (k, v) in [
        ("path", json!(path)),
        ("readonly", json!(readonly)),
        ("direct", json!(direct)),
        ("iommu", json!(false)),
        ("num_queues", json!(1)),
        ("queue_size", json!(128)),
        ("vhost_user", json!(false)),
        ("id", json!(id)),
        ("pci_segment", json!(0)),
    ] {
        info.insert(k.into(), v);
    }
    let cache = if direct {
        CacheMode::None
    } else {
        CacheMode::Writeback
    };
    Ok((
        DiskConfig {
            path,
            readonly,
            cache,
        },
        Value::Object(info),
    ))
}

fn net(i: usize, v: &Value, ids: &mut Vec<String>) -> Result<(NetConfig, Value)> {
    let field = format!("net[{i}]");
    let mut n = Obj::new(&field, v)?;
    let tap = n.string("tap")?;
    let addr = |n: &mut Obj, key: &str| -> Result<Option<std::net::Ipv4Addr>> {
        match n.string(key)? {
            None => Ok(None),
            Some(s) => s.parse().map(Some).map_err(|_| ChConfigError::Type {
                field: format!("{field}.{key}"),
                value: format!("{s:?}"),
                expected: "an IPv4 address",
            }),
        }
    };
    let ip = addr(&mut n, "ip")?;
    let mask = addr(&mut n, "mask")?;
    let mac = match n.string("mac")? {
        None => None,
        Some(s) => Some(s.parse::<MacAddr>().map_err(|_| ChConfigError::Type {
            field: format!("{field}.mac"),
            value: format!("{s:?}"),
            expected: "a MAC address (12:34:56:78:9a:bc)",
        })?),
    };
    let fd = match n.take("fds") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let fds = v.as_array().filter(|a| !a.is_empty()).and_then(|a| {
                a.iter()
                    .map(|f| f.as_i64().and_then(|x| i32::try_from(x).ok()))
                    .collect::<Option<Vec<i32>>>()
            });
            Some(Fds(fds.ok_or_else(|| ChConfigError::Type {
                field: format!("{field}.fds"),
                value: v.to_string(),
                expected: "a list of TAP queue descriptors, one per queue pair",
            })?))
        }
    };
    let queue_size = n.u64("queue_size")?.unwrap_or(256);
    let queue_size = u16::try_from(queue_size).map_err(|_| ChConfigError::Type {
        field: format!("{field}.queue_size"),
        value: queue_size.to_string(),
        expected: "a power of two up to 256",
    })?;
    n.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    n.default_only("pci_segment", &[json!(0)], VIRTIO_MMIO)?;
    n.default_only("pci_device_id", &[Value::Null], VIRTIO_MMIO)?;
    let num_queues = n.u64("num_queues")?.unwrap_or(2);
    let num_queues = u16::try_from(num_queues)
        .ok()
        .filter(|q| q.is_multiple_of(2) && (2..=MAX_NUM_QUEUES).contains(q))
        .ok_or_else(|| ChConfigError::Unsupported {
            field: format!("{field}.num_queues"),
            value: num_queues.to_string(),
            why: "Musubi's virtio-net takes an even number of queues from 2 to 32 (a receive \
                  and a transmit queue per pair)",
        })?;
    const VHOST: &str = "Musubi serves its network devices itself (no vhost-user)";
    n.default_only("vhost_user", &[json!(false)], VHOST)?;
    n.default_only("vhost_socket", &[Value::Null], VHOST)?;
    n.default_only("vhost_mode", &[json!("Client")], VHOST)?;
    n.default_only(
        "host_mac",
        &[Value::Null],
        "Musubi leaves the TAP's MAC alone",
    )?;
    n.default_only("mtu", &[Value::Null], "Musubi leaves the TAP's MTU alone")?;
    n.default_only(
        "rate_limiter_config",
        &[Value::Null],
        "give Musubi's rate limit as --net rate= instead",
    )?;
    const OFFLOAD: &str = "Musubi offers the guest its offloads as the TAP allows";
    for key in ["offload_tso", "offload_ufo", "offload_csum"] {
        n.default_only(key, &[json!(true)], OFFLOAD)?;
    }
    let id = device_id(&mut n, "net", i, ids)?;
    let config = NetConfig {
        tap,
        fd,
        ip,
        mask,
        mac,
        num_queues,
        queue_size,
        rate: None,
    };
    config.check().map_err(|e| ChConfigError::Net(field, e))?;
    let mut info = n.finish()?;
    for (k, val) in [
        ("tap", json!(config.tap)),
        ("ip", json!(config.ip)),
        ("mask", json!(config.mask)),
        ("mac", json!(config.mac)),
        ("iommu", json!(false)),
        ("num_queues", json!(num_queues)),
        ("queue_size", json!(queue_size)),
        ("vhost_user", json!(false)),
        ("vhost_mode", json!("Client")),
        ("id", json!(id)),
        ("pci_segment", json!(0)),
    ] {
        info.insert(k.into(), val);
    }
    Ok((config, Value::Object(info)))
}

fn pmem(i: usize, v: &Value, ids: &mut Vec<String>) -> Result<(PmemConfig, Value)> {
    let mut p = Obj::new(&format!("pmem[{i}]"), v)?;
    let file = p.path("file")?.ok_or_else(|| ChConfigError::Missing {
        field: format!("pmem[{i}].file"),
    })?;
    let size = p.u64("size")?;
    p.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    p.default_only("pci_segment", &[json!(0)], VIRTIO_MMIO)?;
    p.default_only("pci_device_id", &[Value::Null], VIRTIO_MMIO)?;
    p.default_only(
        "discard_writes",
        &[json!(false)],
        "Musubi's memory storage keeps the guest's writes",
    )?;
    let id = device_id(&mut p, "pmem", i, ids)?;
    let mut info = p.finish()?;
    for (k, val) in [
        ("file", json!(file)),
        ("size", json!(size)),
        ("iommu", json!(false)),
        ("discard_writes", json!(false)),
        ("id", json!(id)),
        ("pci_segment", json!(0)),
    ] {
        info.insert(k.into(), val);
    }
    Ok((
        PmemConfig {
            file,
            size,
            readonly: false,
            advertise: Advertise::default(),
        },
        Value::Object(info),
    ))
}

fn serial(v: Option<&Value>) -> Result<(SerialMode, Value)> {
    let default = json!({"mode": "Null"});
    let mut s = Obj::new("serial", v.unwrap_or(&default))?;
    let mode = s.string("mode")?.unwrap_or_else(|| "Null".into());
    let file = s.path("file")?;
    s.default_only(
        "socket",
        &[Value::Null],
        "Musubi's serial goes to a file or stdout",
    )?;
    s.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    let serial = match (mode.as_str(), &file) {
        ("Off" | "Null", _) => SerialMode::Off,
        ("Tty", _) => SerialMode::Stdio,
        ("File", Some(f)) => SerialMode::File(f.clone()),
        ("File", None) => {
            return Err(ChConfigError::Missing {
                field: "serial.file".into(),
            })
        }
        _ => {
            return Err(ChConfigError::Unsupported {
                field: "serial.mode".into(),
                value: format!("{mode:?}"),
                why: "Musubi's serial is Off, Null, Tty or File",
            })
        }
    };
    let mut info = s.finish()?;
    info.insert("mode".into(), json!(mode));
    info.insert("file".into(), json!(file));
    info.insert("iommu".into(), json!(false));
    Ok((serial, Value::Object(info)))
}

/// Musubi has no virtio-console: the console is accepted when absent or off.
fn console(v: Option<&Value>) -> Result<Value> {
    let Some(v) = v else {
        return Ok(json!({"mode": "Off", "file": null, "iommu": false}));
    };
    let mut c = Obj::new("console", v)?;
    let mode = c.string("mode")?.unwrap_or_else(|| "Tty".into());
    if mode != "Off" && mode != "Null" {
        return Err(ChConfigError::Unsupported {
            field: "console.mode".into(),
            value: format!("{mode:?}"),
            why: "Musubi has no virtio-console; use serial (COM1, ttyS0)",
        });
    }
    c.default_only("file", &[Value::Null], "the console is off")?;
    c.default_only("socket", &[Value::Null], "the console is off")?;
    c.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    let mut info = c.finish()?;
    info.insert("mode".into(), json!(mode));
    info.insert("file".into(), Value::Null);
    info.insert("iommu".into(), json!(false));
    Ok(Value::Object(info))
}

/// `"musubi": {"exits": "kernel"|"user", "pmem": [{"advertise": "e820"|"virtio"}, ..]}`:
/// the pmem entries go with the config's `pmem` in order.
/// Musubi's own settings, read from the extension key.
struct Extension {
    exits: ExitsMode,
    advertise: Vec<Advertise>,
    rng_bytes_per_sec: Option<u64>,
    info: Value,
}

/// Cloud Hypervisor's VsockConfig: the guest's cid and the UNIX socket host programs
/// connect to, which must not exist yet (`check_file`) since Musubi creates it.
fn vsock(v: &Value, ids: &mut Vec<String>, check_file: bool) -> Result<(VsockConfig, Value)> {
    let mut o = Obj::new("vsock", v)?;
    let cid = o.u64("cid")?.ok_or_else(|| ChConfigError::Missing {
        field: "vsock.cid".into(),
    })?;
    let socket = o.path("socket")?.ok_or_else(|| ChConfigError::Missing {
        field: "vsock.socket".into(),
    })?;
    o.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    o.default_only("pci_segment", &[json!(0)], VIRTIO_MMIO)?;
    o.default_only("pci_device_id", &[Value::Null], VIRTIO_MMIO)?;
    let id = device_id(&mut o, "vsock", 0, ids)?;
    let config = VsockConfig { cid, socket };
    let checked = if check_file {
        config.check().and_then(|_| config.check_free())
    } else {
        config.check()
    };
    checked.map_err(|e| ChConfigError::Vsock(e.to_string()))?;
    let mut info = o.finish()?;
    for (k, val) in [
        ("cid", json!(cid)),
        ("socket", json!(config.socket)),
        ("iommu", json!(false)),
        ("id", json!(id)),
        ("pci_segment", json!(0)),
    ] {
        info.insert(k.into(), val);
    }
    Ok((config, Value::Object(info)))
}

/// Cloud Hypervisor's `rng: {"src": ...}`: Musubi feeds its virtio-rng from getrandom(2),
/// the kernel's own pool, which is what both of the kernel's devices read.
fn rng(v: Option<&Value>) -> Result<Option<Value>> {
    let Some(v) = v else {
        return Ok(None);
    };
    let mut r = Obj::new("rng", v)?;
    let src = r.string("src")?.unwrap_or_else(|| "/dev/urandom".into());
    if src != "/dev/urandom" && src != "/dev/random" {
        return Err(ChConfigError::Unsupported {
            field: "rng.src".into(),
            value: format!("{src:?}"),
            why: "Musubi feeds virtio-rng from getrandom(2), the kernel's pool; give /dev/urandom",
        });
    }
    r.default_only("iommu", &[json!(false)], VIRTIO_MMIO)?;
    let mut info = r.finish()?;
    info.insert("src".into(), json!(src));
    info.insert("iommu".into(), json!(false));
    Ok(Some(Value::Object(info)))
}

fn extension(v: Option<&Value>, pmems: usize) -> Result<Extension> {
    let empty = json!({});
    let mut m = Obj::new(EXTENSION, v.unwrap_or(&empty))?;
    let exits = match m.string("exits")? {
        None => ExitsMode::default(),
        Some(s) => s.parse().map_err(|_| ChConfigError::Type {
            field: format!("{EXTENSION}.exits"),
            value: format!("{s:?}"),
            expected: "\"kernel\" or \"user\"",
        })?,
    };
    let list = m.array("pmem")?;
    if list.len() > pmems {
        return Err(ChConfigError::Type {
            field: format!("{EXTENSION}.pmem"),
            value: format!("{} entries", list.len()),
            expected: "at most one entry per entry of pmem",
        });
    }
    let mut advertise = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let mut o = Obj::new(&format!("{EXTENSION}.pmem[{i}]"), e)?;
        let a = match o.string("advertise")? {
            None => Advertise::default(),
            Some(s) => s.parse().map_err(|_| ChConfigError::Type {
                field: format!("{EXTENSION}.pmem[{i}].advertise"),
                value: format!("{s:?}"),
                expected: "\"e820\" or \"virtio\"",
            })?,
        };
        o.finish()?;
        advertise.push(a);
    }
    let rng_bytes_per_sec = match m.object("rng")? {
        None => None,
        Some(r) => {
            let mut o = Obj::new(&format!("{EXTENSION}.rng"), r)?;
            let n = o.u64("bytes_per_sec")?.filter(|&n| n > 0);
            o.finish()?;
            Some(n.ok_or_else(|| ChConfigError::Missing {
                field: format!("{EXTENSION}.rng.bytes_per_sec (a positive whole number)"),
            })?)
        }
    };
    m.finish()?;
    let mut info = json!({
        "exits": exits.to_string(),
        "pmem": advertise.iter().map(|a| json!({"advertise": a.to_string()})).collect::<Vec<_>>(),
    });
    if let Some(n) = rng_bytes_per_sec {
        info["rng"] = json!({ "bytes_per_sec": n });
    }
    Ok(Extension {
        exits,
        advertise,
        rng_bytes_per_sec,
        info,
    })
}

/// One JSON object being read: every key taken is remembered, and [`Obj::finish`] refuses
/// the ones nobody took, so no field is ignored unseen.
struct Obj<'a> {
    path: String,
    map: &'a Map<String, Value>,
    taken: Vec<String>,
}

impl<'a> Obj<'a> {
    fn new(path: &str, v: &'a Value) -> Result<Obj<'a>> {
        match v {
            Value::Object(map) => Ok(Obj {
                path: path.to_string(),
                map,
                taken: Vec::new(),
            }),
            other => Err(ChConfigError::Type {
                field: if path.is_empty() {
                    "VmConfig".into()
                } else {
                    path.into()
                },
                value: other.to_string(),
                expected: "an object",
            }),
        }
    }

    fn field(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn take(&mut self, key: &str) -> Option<&'a Value> {
        self.taken.push(key.to_string());
        self.map.get(key)
    }

    fn typed<T>(
        &mut self,
        key: &str,
        expected: &'static str,
        get: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.take(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => get(v).map(Some).ok_or_else(|| ChConfigError::Type {
                field: self.field(key),
                value: v.to_string(),
                expected,
            }),
        }
    }

    fn string(&mut self, key: &str) -> Result<Option<String>> {
        self.typed(key, "a string", |v| v.as_str().map(String::from))
    }

    fn path(&mut self, key: &str) -> Result<Option<PathBuf>> {
        self.typed(key, "a non-empty path", |v| {
            v.as_str().filter(|s| !s.is_empty()).map(PathBuf::from)
        })
    }

    fn u64(&mut self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a whole number", Value::as_u64)
    }

    fn bool(&mut self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "true or false", Value::as_bool)
    }

    fn object(&mut self, key: &str) -> Result<Option<&'a Value>> {
        self.typed(key, "an object", |v| v.is_object().then_some(v))
    }

    fn array(&mut self, key: &str) -> Result<&'a [Value]> {
        Ok(self
            .typed(key, "an array", |v| v.as_array().map(Vec::as_slice))?
            .unwrap_or(&[]))
    }

    /// Accepts `key` only absent or at one of `defaults` (the first is Cloud Hypervisor's
    /// own); any other value is refused with `why`.
    fn default_only(&mut self, key: &str, defaults: &[Value], why: &'static str) -> Result<()> {
        match self.take(key) {
            None => Ok(()),
            Some(v) if defaults.contains(v) => Ok(()),
            Some(v) => Err(ChConfigError::Unsupported {
                field: self.field(key),
                value: v.to_string(),
                why,
            }),
        }
    }

    /// The keys given and taken, as given, to be overwritten with the values used; an
    /// error for the first key not taken.
    fn finish(self) -> Result<Map<String, Value>> {
        if let Some(key) = self.map.keys().find(|k| !self.taken.contains(k)) {
            return Err(ChConfigError::Unknown(self.field(key)));
        }
        Ok(self
            .map
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel() -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let k = dir.path().join("vmlinux");
        std::fs::write(&k, b"not really a kernel").unwrap();
        let s = k.display().to_string();
        (dir, s)
    }

    fn parsed(kernel: &str, extra: &str) -> Result<ChVm> {
        parse(format!(r#"{{"payload": {{"kernel": "{kernel}"}}{extra}}}"#).as_bytes())
    }

    #[test]
    fn an_rng_is_fed_from_getrandom_with_musubis_rate_under_the_extension_key() {
        let (_d, k) = kernel();
        assert_eq!(parsed(&k, "").unwrap().config.rng, None);
        let vm = parsed(&k, r#", "rng": {"src": "/dev/urandom", "iommu": false}"#).unwrap();
        assert_eq!(vm.config.rng, Some(RngConfig::default()));
        assert_eq!(vm.info["rng"]["src"], "/dev/urandom");
        let limited = r#", "rng": {}, "musubi": {"rng": {"bytes_per_sec": 4096}}"#;
        let vm = parsed(&k, limited).unwrap();
        let want = RngConfig {
            bytes_per_sec: Some(4096),
        };
        assert_eq!(vm.config.rng, Some(want));
        // What vm.info shows reads back as the same VM.
        assert_eq!(from_value(&vm.info).unwrap().config.rng, Some(want));
        assert_eq!(ChVm::from_config(vm.config).info["rng"], vm.info["rng"]);
    }

    #[test]
    fn a_vsock_is_read_cold_added_once_and_removed_by_its_id() {
        let (d, k) = kernel();
        let socket = d.path().join("v.sock");
        let vm = parsed(&k, "").unwrap();
        let body = format!(
            r#"{{"cid": 3, "socket": "{}", "iommu": false}}"#,
            socket.display()
        );
        let (vm, id) = vm.add_device(DeviceKind::Vsock, body.as_bytes()).unwrap();
        assert_eq!(id, "_vsock0");
        let want = VsockConfig {
            cid: 3,
            socket: socket.clone(),
        };
        assert_eq!(vm.config.vsock.as_ref(), Some(&want));
        assert!(vm.vm_info("Created")["device_tree"]["_vsock0"].is_object());
        let again = vm
            .add_device(DeviceKind::Vsock, body.as_bytes())
            .unwrap_err();
        assert_eq!(again, ChConfigError::SecondVsock("_vsock0".into()));
        let vm = vm.remove_device("_vsock0").unwrap();
        assert_eq!(vm.config.vsock, None);
        // A path that is taken already is refused at create, naming it.
        std::fs::write(&socket, b"").unwrap();
        let e = vm
            .add_device(DeviceKind::Vsock, body.as_bytes())
            .unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
    }

    #[test]
    fn a_minimal_config_takes_cloud_hypervisors_defaults() {
        let (_d, k) = kernel();
        let vm = parsed(&k, "").unwrap();
        assert_eq!(vm.config.cpus, 1);
        assert_eq!(vm.config.memory, 512 << 20);
        assert_eq!(vm.config.serial, SerialMode::Off);
        assert_eq!(vm.info["cpus"]["boot_vcpus"], 1);
        assert_eq!(vm.info["memory"]["size"], 512u64 << 20);
        assert_eq!(vm.info["serial"]["mode"], "Null");
        assert_eq!(vm.info["payload"]["kernel"], k.as_str());
    }

    #[test]
    fn devices_get_cloud_hypervisors_ids_and_defaults_are_accepted() {
        let (d, k) = kernel();
        let img = d.path().join("a.img");
        std::fs::write(&img, vec![0; 4096]).unwrap();
        let img = img.display();
        let vm = parsed(
            &k,
            &format!(
                r#", "cpus": {{"boot_vcpus": 2, "max_vcpus": 2}},
                "memory": {{"size": 134217728, "shared": false, "hugepages": false}},
                "disks": [{{"path": "{img}", "iommu": false, "num_queues": 1,
                    "queue_size": 128, "vhost_user": false, "pci_segment": 0, "direct": true}},
                    {{"path": "{img}", "id": "mine", "readonly": true}}],
                "net": [{{"tap": "tap7", "num_queues": 2, "queue_size": 256, "iommu": false,
                    "mac": "12:34:56:78:9a:bc"}}],
                "serial": {{"mode": "Tty"}}, "console": {{"mode": "Off"}},
                "musubi": {{"exits": "user"}}"#
            ),
        )
        .unwrap();
        assert_eq!(vm.config.cpus, 2);
        assert_eq!(vm.config.memory, 128 << 20);
        assert_eq!(vm.config.disks[0].cache, CacheMode::None);
        assert!(vm.config.disks[1].readonly);
        assert_eq!(vm.config.serial, SerialMode::Stdio);
        assert_eq!(vm.config.exits, ExitsMode::User);
        assert_eq!(vm.config.net[0].tap.as_deref(), Some("tap7"));
        assert_eq!(vm.info["disks"][0]["id"], "_disk0");
        assert_eq!(vm.info["disks"][1]["id"], "mine");
        assert_eq!(vm.info["net"][0]["id"], "_net0");
        assert_eq!(vm.info["net"][0]["mac"], "12:34:56:78:9a:bc");
        assert_eq!(vm.config.net[0].num_queues, 2);
        assert_eq!(vm.info["net"][0]["num_queues"], 2);
    }

    #[test]
    fn net_num_queues_map_to_queue_pairs() {
        let (_d, k) = kernel();
        let vm = parsed(
            &k,
            r#", "net": [{"tap": "tap7", "num_queues": 8}, {"tap": "tap8"}]"#,
        )
        .unwrap();
        assert_eq!(vm.config.net[0].num_queues, 8);
        assert_eq!(vm.config.net[0].queue_pairs(), 4);
        assert_eq!(vm.info["net"][0]["num_queues"], 8);
        assert_eq!(vm.config.net[1].num_queues, 2);
        assert_eq!(vm.info["net"][1]["num_queues"], 2);
        // A VM built from elsewhere (a snapshot, a migration) shows them the same.
        let again = ChVm::from_config(vm.config.clone());
        assert_eq!(again.info["net"], vm.info["net"]);
        assert_eq!(again.config.net, vm.config.net);
    }

    #[test]
    fn net_fds_are_one_tap_queue_per_pair() {
        let (_d, k) = kernel();
        let vm = parsed(&k, r#", "net": [{"fds": [7, 8, 9], "num_queues": 6}]"#).unwrap();
        assert_eq!(vm.config.net[0].fd, Some(Fds(vec![7, 8, 9])));
        assert_eq!(vm.config.net[0].queue_pairs(), 3);
        assert_eq!(vm.info["net"][0]["fds"], json!([7, 8, 9]));
        let again = ChVm::from_config(vm.config.clone());
        assert_eq!(again.info["net"], vm.info["net"]);
    }

    #[test]
    fn what_musubi_cannot_honour_is_refused_naming_field_and_value() {
        let (d, k) = kernel();
        let img = d.path().join("a.img");
        std::fs::write(&img, vec![0; 4096]).unwrap();
        let img = img.display();
        for (extra, says) in [
            (
                r#", "memory": {"size": 134217728, "hugepages": true}"#.to_string(),
                "memory.hugepages true: not supported by Musubi",
            ),
            (
                format!(r#", "disks": [{{"path": "{img}", "vhost_user": true}}]"#),
                "disks[0].vhost_user true: not supported",
            ),
            (
                format!(r#", "disks": [{{"path": "{img}", "num_queues": 2}}]"#),
                "disks[0].num_queues 2",
            ),
            (
                r#", "net": [{"tap": "t0", "num_queues": 3}]"#.into(),
                "net[0].num_queues 3: not supported by Musubi: Musubi's virtio-net takes an even",
            ),
            (
                r#", "net": [{"tap": "t0", "num_queues": 34}]"#.into(),
                "net[0].num_queues 34",
            ),
            (
                r#", "net": [{"fds": [7], "num_queues": 4}]"#.into(),
                "num_queues=4 with fd=7",
            ),
            (
                r#", "net": [{"fds": [7, 8]}]"#.into(),
                "num_queues=2 with fd=7:8",
            ),
            (
                r#", "net": [{"fds": [7, "eight"], "num_queues": 4}]"#.into(),
                "net[0].fds [7,\"eight\"]: expected a list of TAP queue descriptors",
            ),
            (r#", "net": [{"fds": []}]"#.into(), "net[0].fds []"),
            (
                r#", "net": [{"tap": "t0", "iommu": true}]"#.into(),
                "net[0].iommu true",
            ),
            (
                r#", "cpus": {"boot_vcpus": 1, "max_vcpus": 4}"#.into(),
                "cpus.max_vcpus 4: not supported by Musubi: Musubi has no CPU hot-plug",
            ),
            (r#", "colour": "red""#.into(), "colour: unknown field"),
            (
                r#", "memory": {"size": 134217728, "colour": 1}"#.into(),
                "memory.colour: unknown field",
            ),
            (
                r#", "vsock": {"cid": 2, "socket": "/tmp/v"}"#.into(),
                "vsock: cid 2 is reserved",
            ),
            (
                r#", "vsock": {"socket": "/tmp/v"}"#.into(),
                "vsock.cid: missing",
            ),
            (
                r#", "rng": {"src": "/dev/hwrng"}"#.into(),
                "rng.src \"/dev/hwrng\": not supported by Musubi",
            ),
            (
                r#", "musubi": {"rng": {"bytes_per_sec": 100}}"#.into(),
                "rng (musubi.rng limits the rate of the VmConfig's rng device): missing",
            ),
            (
                r#", "console": {"mode": "Tty"}"#.into(),
                "console.mode \"Tty\": not supported",
            ),
            (
                r#", "serial": {"mode": "Pty"}"#.into(),
                "serial.mode \"Pty\"",
            ),
            (
                format!(
                    r#", "disks": [{{"path": "{img}", "id": "x"}}, {{"path": "{img}", "id": "x"}}]"#
                ),
                "disks[1].id \"x\": the id is used twice",
            ),
            (
                r#", "cpus": {"boot_vcpus": "two"}"#.into(),
                "cpus.boot_vcpus \"two\": expected a whole number",
            ),
            (r#", "balloon": {"size": 1}"#.into(), "balloon {\"size\":1}"),
            (
                r#", "musubi": {"exits": "maybe"}"#.into(),
                "musubi.exits \"maybe\"",
            ),
        ] {
            let e = parsed(&k, &extra).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        let e = parse(br#"{"cpus": {}}"#).unwrap_err().to_string();
        assert!(e.contains("payload: missing"), "{e}");
        let e = parsed("/no/such/kernel", "").unwrap_err().to_string();
        assert!(e.contains("payload.kernel \"/no/such/kernel\""), "{e}");
    }

    #[test]
    fn only_a_config_with_a_payload_is_cloud_hypervisors() {
        assert!(is_ch_config(&json!({"payload": {"kernel": "k"}})));
        assert!(!is_ch_config(&json!({"kernel": "probe", "cpus": 2})));
    }

    #[test]
    fn cold_plugged_devices_follow_the_configs_own_rules_and_ids() {
        let (d, k) = kernel();
        let img = d.path().join("a.img");
        std::fs::write(&img, vec![0; 4096]).unwrap();
        let img = img.display().to_string();
        let vm = parsed(&k, &format!(r#", "disks": [{{"path": "{img}"}}]"#)).unwrap();
        // The config round-trips: what vm.info shows is read back unchanged.
        assert_eq!(from_value(&vm.info).unwrap().info, vm.info);
        let disk = |extra: &str| format!(r#"{{"path": "{img}"{extra}}}"#);
        let (vm, id) = vm
            .add_device(DeviceKind::Disk, disk(", \"iommu\": false").as_bytes())
            .unwrap();
        assert_eq!(id, "_disk1");
        assert_eq!(vm.config.disks.len(), 2);
        assert_eq!(vm.info["disks"][1]["id"], "_disk1");
        let (vm, id) = vm
            .add_device(DeviceKind::Disk, disk(r#", "id": "data""#).as_bytes())
            .unwrap();
        assert_eq!(id, "data");
        let e = vm
            .add_device(DeviceKind::Disk, disk(r#", "id": "_disk0""#).as_bytes())
            .unwrap_err();
        assert_eq!(e, ChConfigError::TakenId("_disk0".into()));
        let e = vm
            .add_device(DeviceKind::Disk, disk(r#", "vhost_user": true"#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("disks[3].vhost_user true: not supported"), "{e}");
        let (vm, id) = vm
            .add_device(DeviceKind::Net, br#"{"tap": "tap3", "num_queues": 2}"#)
            .unwrap();
        assert_eq!((id.as_str(), vm.config.net.len()), ("_net0", 1));
        let pmem = format!(r#"{{"file": "{img}"}}"#);
        let (vm, id) = vm.add_device(DeviceKind::Pmem, pmem.as_bytes()).unwrap();
        assert_eq!((id.as_str(), vm.config.pmem.len()), ("_pmem0", 1));

        // ch-remote add-disk fills in Cloud Hypervisor's defaults.
        let filled = r#", "pci_segment": 0, "readonly": false, "direct": false,
            "num_queues": 1, "queue_size": 128, "vhost_user": false, "disable_io_uring": false,
            "disable_aio": false, "backing_files": false, "sparse": true,
            "image_type": "Unknown", "lock_granularity": "ByteRange""#;
        let (vm, id) = vm
            .add_device(DeviceKind::Disk, disk(filled).as_bytes())
            .unwrap();
        assert_eq!(id, "_disk3");
        let vm = vm.remove_device("_disk3").unwrap();
        let vm = vm.remove_device("_disk0").unwrap();
        assert_eq!(vm.config.disks.len(), 2);
        assert_eq!(vm.info["disks"][0]["id"], "_disk1");
        // The next id skips the one a remaining disk has.
        let (vm, id) = vm
            .add_device(DeviceKind::Disk, disk("").as_bytes())
            .unwrap();
        assert_eq!(id, "_disk2");
        let vm = vm.remove_device("_pmem0").unwrap();
        assert!(vm.config.pmem.is_empty());
        assert_eq!(
            vm.remove_device("_pmem0").unwrap_err(),
            ChConfigError::UnknownId("_pmem0".into())
        );
    }
}

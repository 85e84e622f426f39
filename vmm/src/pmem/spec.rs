//! What `--pmem` and the JSON config's `pmem` entries ask for: parsed and checked for form,
//! before any file is touched.

use crate::config::spec::{self, Spec};
use crate::config::{ConfigError, Size};
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;

pub const PMEM_SYNTAX: &str = "file=PATH[,size=SIZE][,readonly=on][,advertise=e820|virtio]";

/// How the guest learns where a region is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Advertise {
    /// An E820 type-12 (legacy persistent memory) entry in boot_params and the PVH memory map:
    /// Linux makes `/dev/pmemN` of it with no driver beyond `nd_e820`.
    #[default]
    E820,
    /// A virtio-pmem device whose configuration names the range; not in the E820 map.
    Virtio,
}

/// The words of `advertise=`, for parsing and printing alike.
const ADVERTISE_WORDS: [(&str, Advertise); 2] =
    [("e820", Advertise::E820), ("virtio", Advertise::Virtio)];

impl std::str::FromStr for Advertise {
    type Err = spec::UnknownWord;

    fn from_str(s: &str) -> Result<Advertise, spec::UnknownWord> {
        spec::word(s, &ADVERTISE_WORDS)
    }
}

impl fmt::Display for Advertise {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(spec::name_of(*self, &ADVERTISE_WORDS))
    }
}

/// One `--pmem` as the user gave it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "PmemJson")]
pub struct PmemConfig {
    pub file: PathBuf,
    /// Bytes the guest sees; `None` means the file's length.
    pub size: Option<u64>,
    pub readonly: bool,
    pub advertise: Advertise,
}

/// The JSON form, with the flag's words and sizes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PmemJson {
    file: PathBuf,
    #[serde(default)]
    size: Option<Size>,
    #[serde(default)]
    readonly: bool,
    #[serde(default, deserialize_with = "spec::from_str")]
    advertise: Advertise,
}

impl TryFrom<PmemJson> for PmemConfig {
    type Error = &'static str;

    fn try_from(j: PmemJson) -> Result<Self, &'static str> {
        if j.file.as_os_str().is_empty() {
            return Err("file is empty");
        }
        Ok(PmemConfig {
            file: j.file,
            size: j.size.map(Size::bytes),
            readonly: j.readonly,
            advertise: j.advertise,
        })
    }
}

impl std::str::FromStr for PmemConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let keys = ["file", "size", "readonly", "advertise"];
        let spec = Spec::parse("--pmem", PMEM_SYNTAX, text, &keys)?;
        Ok(PmemConfig {
            file: spec.path("file")?,
            size: spec.size("size")?,
            readonly: spec.on_off("readonly")?,
            advertise: spec.value("advertise")?.unwrap_or_default(),
        })
    }
}

/// The flag's own form, defaults left out, so a command line made from a parsed `--pmem`
/// parses back to the same region.
impl fmt::Display for PmemConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file={}", self.file.display())?;
        if let Some(size) = self.size {
            write!(f, ",size={}", Size(size))?;
        }
        if self.readonly {
            f.write_str(",readonly=on")?;
        }
        if self.advertise != Advertise::default() {
            write!(f, ",advertise={}", self.advertise)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn specs_parse() {
        let c: PmemConfig = "file=/tmp/a.img,size=64M,readonly=on,advertise=virtio"
            .parse()
            .unwrap();
        assert_eq!(
            c,
            PmemConfig {
                file: "/tmp/a.img".into(),
                size: Some(64 * MIB),
                readonly: true,
                advertise: Advertise::Virtio
            }
        );
        let c: PmemConfig = "file=x".parse().unwrap();
        assert_eq!(
            (c.size, c.readonly, c.advertise),
            (None, false, Advertise::E820)
        );
    }

    #[test]
    fn specs_print_as_specs_that_parse_back() {
        for text in [
            "file=a.img",
            "file=/p/b.img,size=1.5G,readonly=on,advertise=virtio",
        ] {
            let c: PmemConfig = text.parse().unwrap();
            assert_eq!(c.to_string(), text);
        }
        let c: PmemConfig = "advertise=e820,size=2097152,file=x".parse().unwrap();
        assert_eq!(c.to_string(), "file=x,size=2M");
        assert_eq!(c.to_string().parse::<PmemConfig>().unwrap(), c);
    }

    #[test]
    fn malformed_specs_name_the_flag_and_the_problem() {
        spec::assert_refusals::<PmemConfig>(
            "--pmem",
            PMEM_SYNTAX,
            &[
                ("size=2M", "file= is missing"),
                ("file=", "file is empty"),
                ("file=a,size=lots", "size=\"lots\": invalid size"),
                ("file=a,readonly=maybe", "readonly=\"maybe\""),
                (
                    "file=a,advertise=acpi",
                    "advertise=\"acpi\": expected e820 or virtio",
                ),
                ("file=a,colour=red", "unknown key"),
            ],
        );
    }

    #[test]
    fn json_form_takes_numbers_and_strings() {
        let v: Vec<PmemConfig> = serde_json::from_str(
            r#"[{"file":"a","size":"4M"},{"file":"b","size":2097152,"readonly":true,"advertise":"virtio"}]"#,
        )
        .unwrap();
        assert_eq!(v[0].size, Some(4 * MIB));
        assert_eq!(v[1].size, Some(2 * MIB));
        assert!(v[1].readonly);
        assert_eq!(v[1].advertise, Advertise::Virtio);
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","size":"big"}"#).is_err());
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","colour":1}"#).is_err());
        assert!(serde_json::from_str::<PmemConfig>(r#"{"file":"a","advertise":"acpi"}"#).is_err());
    }
}

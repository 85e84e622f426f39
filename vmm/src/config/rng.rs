//! `--rng`: the entropy device as the user asks for it, checked before it is built.

use super::spec::Spec;
use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

pub const RNG_SYNTAX: &str = "[bytes_per_sec=N]";

/// A virtio-rng device fed from the host's getrandom(2). Plain data: whoever reads another
/// configuration format (a Cloud Hypervisor VmConfig) builds one directly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngConfig {
    /// At most this many random bytes a second reach the guest (a token bucket one second
    /// deep); `None`: as fast as the guest asks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_sec: Option<u64>,
}

impl FromStr for RngConfig {
    type Err = ConfigError;

    /// `--rng` alone comes here as an empty value: a device without a limit.
    fn from_str(text: &str) -> Result<Self, ConfigError> {
        if text.is_empty() {
            return Ok(RngConfig::default());
        }
        let spec = Spec::parse("--rng", RNG_SYNTAX, text, &["bytes_per_sec"])?;
        let bytes_per_sec = match spec.get("bytes_per_sec") {
            None => None,
            Some(v) => match v.parse::<u64>() {
                Ok(0) => return Err(spec.error("bytes_per_sec=0 would never serve a byte")),
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(spec.error(format!(
                        "bytes_per_sec={v:?} is not a positive whole number"
                    )))
                }
            },
        };
        Ok(RngConfig { bytes_per_sec })
    }
}

/// The flag's own form (empty for the default), so it parses back to the same device.
impl fmt::Display for RngConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bytes_per_sec {
            Some(n) => write!(f, "bytes_per_sec={n}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::spec::assert_refusals;

    #[test]
    fn specs_parse_and_print_back() {
        assert_eq!("".parse::<RngConfig>().unwrap(), RngConfig::default());
        let r: RngConfig = "bytes_per_sec=4096".parse().unwrap();
        assert_eq!(r.bytes_per_sec, Some(4096));
        for text in ["", "bytes_per_sec=1"] {
            assert_eq!(text.parse::<RngConfig>().unwrap().to_string(), text);
        }
    }

    #[test]
    fn bad_specs_name_the_flag_and_the_value() {
        assert_refusals::<RngConfig>(
            "--rng",
            RNG_SYNTAX,
            &[
                ("bytes_per_sec=0", "would never serve a byte"),
                (
                    "bytes_per_sec=fast",
                    "\"fast\" is not a positive whole number",
                ),
                ("bytes_per_sec=-1", "\"-1\" is not a positive whole number"),
                ("bytes_per_sec=1.5", "\"1.5\" is not a positive"),
                ("src=/dev/urandom", "unknown key \"src\""),
                ("4096", "\"4096\" is not key=value"),
                ("bytes_per_sec=1,bytes_per_sec=2", "given twice"),
            ],
        );
    }

    #[test]
    fn json_takes_the_same_fields() {
        let r: RngConfig = serde_json::from_str(r#"{"bytes_per_sec": 100}"#).unwrap();
        assert_eq!(r.bytes_per_sec, Some(100));
        assert_eq!(serde_json::to_string(&RngConfig::default()).unwrap(), "{}");
        assert!(serde_json::from_str::<RngConfig>(r#"{"rate": 1}"#).is_err());
    }
}

//! `key=value,...` specs of repeatable flags (`--disk`, `--pmem`): one grammar and one set of
//! refusals (not key=value, unknown key, a key given twice) for all of them.

use super::{ConfigError, Size};
use serde::{Deserialize, Deserializer};
use std::fmt::Display;
use std::path::PathBuf;
use std::str::FromStr;

/// One flag's spec split into its pairs, every key known and given at most once.
pub struct Spec<'a> {
    flag: &'static str,
    syntax: &'static str,
    text: &'a str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Spec<'a> {
    /// Splits `text`, the value of `flag`, whose keys may be `keys`; `syntax` is what the
    /// flag accepts, quoted in every error.
    pub fn parse(
        flag: &'static str,
        syntax: &'static str,
        text: &'a str,
        keys: &[&str],
    ) -> Result<Spec<'a>, ConfigError> {
        let mut spec = Spec {
            flag,
            syntax,
            text,
            pairs: Vec::new(),
        };
        for part in text.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(spec.error(format!("{part:?} is not key=value")));
            };
            if !keys.contains(&key) {
                return Err(spec.error(format!("unknown key {key:?} (keys: {})", keys.join(", "))));
            }
            if spec.get(key).is_some() {
                return Err(spec.error(format!("{key}= is given twice")));
            }
            spec.pairs.push((key, value));
        }
        Ok(spec)
    }

    /// The refusal of this spec, naming the flag, the spec and what would be accepted.
    pub fn error(&self, why: impl Into<String>) -> ConfigError {
        ConfigError::BadSpec {
            flag: self.flag,
            spec: self.text.to_string(),
            why: why.into(),
            syntax: self.syntax,
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    /// A path that must be given and not be empty.
    pub fn path(&self, key: &str) -> Result<PathBuf, ConfigError> {
        match self.get(key) {
            None => Err(self.error(format!("{key}= is missing"))),
            Some("") => Err(self.error(format!("{key} is empty"))),
            Some(v) => Ok(PathBuf::from(v)),
        }
    }

    /// `on`/`off` (or true/false, yes/no, 1/0); off when not given.
    pub fn on_off(&self, key: &str) -> Result<bool, ConfigError> {
        match self.get(key) {
            None | Some("off" | "false" | "no" | "0") => Ok(false),
            Some("on" | "true" | "yes" | "1") => Ok(true),
            Some(v) => Err(self.error(format!("{key}={v:?} is not on or off"))),
        }
    }

    /// A value of a type that parses itself (a choice, a size); `None` when not given.
    pub fn value<T: FromStr>(&self, key: &str) -> Result<Option<T>, ConfigError>
    where
        T::Err: Display,
    {
        self.get(key)
            .map(|v| {
                v.parse()
                    .map_err(|e| self.error(format!("{key}={v:?}: {e}")))
            })
            .transpose()
    }

    /// A size (`64M`, `1.5G`); `None` when not given.
    pub fn size(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        self.get(key)
            .map(|v| {
                v.parse::<Size>()
                    .map(Size::bytes)
                    .map_err(|e| self.error(format!("{key}={v:?}: invalid size: {e}")))
            })
            .transpose()
    }
}

/// A word that is none of those accepted, with the ones that are.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected {}", .expected.join(" or "))]
pub struct UnknownWord {
    pub expected: Vec<String>,
}

/// A flag's value that is none of its words, named with the flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {value:?}: {source}")]
pub struct BadWord {
    pub flag: &'static str,
    pub value: String,
    pub source: UnknownWord,
}

/// The value `text` names among `words`, or what would have been accepted.
pub fn word<T: Copy>(text: &str, words: &[(&str, T)]) -> Result<T, UnknownWord> {
    match words.iter().find(|(w, _)| *w == text) {
        Some((_, value)) => Ok(*value),
        None => Err(UnknownWord {
            expected: words.iter().map(|(w, _)| w.to_string()).collect(),
        }),
    }
}

/// The word `words` give `value`.
pub fn name_of<T: Copy + PartialEq>(value: T, words: &[(&'static str, T)]) -> &'static str {
    words
        .iter()
        .find(|(_, v)| *v == value)
        .map_or("?", |(w, _)| w)
}

/// Deserializes a JSON string through `FromStr`, so the JSON config accepts exactly the
/// words the flag does (`"cache": "none"`).
pub fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    let s = String::deserialize(d)?;
    s.parse()
        .map_err(|e| serde::de::Error::custom(format!("{s:?}: {e}")))
}

/// Asserts that each `(spec, why)` is refused as `--flag "spec": ...why...; expected SYNTAX`:
/// what every spec flag promises about its errors.
#[cfg(test)]
pub fn assert_refusals<T>(flag: &str, syntax: &str, cases: &[(&str, &str)])
where
    T: FromStr<Err = ConfigError> + std::fmt::Debug,
{
    for (text, why) in cases {
        let e = text.parse::<T>().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{flag} {text:?}: ")) && e.contains(why),
            "{text}: {e}"
        );
        assert!(e.ends_with(&format!("; expected {syntax}")), "{e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: [&str; 3] = ["path", "readonly", "size"];

    fn parse(text: &str) -> Result<Spec<'_>, ConfigError> {
        Spec::parse("--thing", "path=FILE[,readonly=on]", text, &KEYS)
    }

    #[test]
    fn words_name_the_choices() {
        let words = [("on", true), ("off", false)];
        assert_eq!(word("off", &words), Ok(false));
        assert_eq!(
            word("maybe", &words).unwrap_err().to_string(),
            "expected on or off"
        );
        assert_eq!(name_of(false, &words), "off");
    }

    #[test]
    fn pairs_are_found_by_key() {
        let s = parse("readonly=on,path=/a,size=1.5M").unwrap();
        assert_eq!(s.path("path").unwrap(), PathBuf::from("/a"));
        assert!(s.on_off("readonly").unwrap());
        assert_eq!(s.size("size").unwrap(), Some(3 << 19));
        let s = parse("path=x").unwrap();
        assert!(!s.on_off("readonly").unwrap());
        assert_eq!(s.size("size").unwrap(), None);
    }

    #[test]
    fn refusals_name_the_flag_the_spec_and_the_syntax() {
        for (text, why) in [
            ("path=a,path=b", "path= is given twice"),
            (
                "path=a,colour=red",
                "unknown key \"colour\" (keys: path, readonly, size)",
            ),
            ("/tmp/a", "\"/tmp/a\" is not key=value"),
            ("path=a,", "\"\" is not key=value"),
        ] {
            let e = parse(text).err().expect(text).to_string();
            assert_eq!(
                e,
                format!("--thing {text:?}: {why}; expected path=FILE[,readonly=on]")
            );
        }
        let s = parse("readonly=maybe,size=lots,path=").unwrap();
        let e = |r: Result<(), ConfigError>| r.unwrap_err().to_string();
        assert!(e(s.on_off("readonly").map(drop)).contains("readonly=\"maybe\" is not on or off"));
        assert!(e(s.size("size").map(drop))
            .contains("size=\"lots\": invalid size: \"lots\" is not a number"));
        assert!(e(s.path("path").map(drop)).contains("path is empty"));
        assert!(e(parse("size=1M").unwrap().path("path").map(drop)).contains("path= is missing"));
    }
}

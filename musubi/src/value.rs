//! clap value parsers that refuse a bad value with the value's own message, which already
//! names the flag and the value, rather than inside clap's "invalid value" sentence that
//! would name them twice.

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use std::ffi::OsStr;
use std::fmt::Display;
use std::str::FromStr;

/// Parses a flag's value with `F`; its error is the whole message clap prints.
#[derive(Clone, Copy, Debug)]
pub struct Own<F>(pub F);

impl<F, T, E> TypedValueParser for Own<F>
where
    F: Fn(&str) -> Result<T, E> + Clone + Send + Sync + 'static,
    T: Clone + Send + Sync + 'static,
    E: Display,
{
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let text = value
            .to_str()
            .ok_or_else(|| clap::Error::new(ErrorKind::InvalidUtf8).with_cmd(cmd))?;
        (self.0)(text).map_err(|e| {
            clap::Error::raw(ErrorKind::ValueValidation, format!("{e}\n")).with_cmd(cmd)
        })
    }
}

/// `str::parse` for `T`.
type Parse<T> = fn(&str) -> Result<T, <T as FromStr>::Err>;

/// A value of a type that parses itself and names its flag when it cannot (`--disk`,
/// `--serial`, ...).
pub fn from_str<T>() -> Own<Parse<T>>
where
    T: FromStr + Clone + Send + Sync + 'static,
    T::Err: Display,
{
    Own(str::parse::<T>)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Flags {
        #[arg(long, value_parser = from_str::<vmm::config::DiskConfig>())]
        disk: Vec<vmm::config::DiskConfig>,
        #[arg(long, value_parser = Own(|s: &str| s.parse::<u8>().map_err(|e| format!("--n {s:?}: {e}"))))]
        n: Option<u8>,
    }

    #[test]
    fn refusals_are_the_values_own_messages() {
        let f = Flags::try_parse_from(["x", "--disk", "path=a", "--disk", "path=b", "--n", "7"])
            .unwrap();
        assert_eq!(f.disk.len(), 2);
        assert_eq!(f.n, Some(7));
        let e = Flags::try_parse_from(["x", "--disk", "cache=none"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        let text = e.to_string();
        assert!(
            text.starts_with("error: --disk \"cache=none\": path= is missing; expected "),
            "{text}"
        );
        assert!(!text.contains("invalid value"), "{text}");
        let e = Flags::try_parse_from(["x", "--n", "300"]).unwrap_err();
        assert!(e.to_string().contains("--n \"300\": "), "{e}");
    }
}

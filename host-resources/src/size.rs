//! Sizes as people write them (`4096`, `256M`, `1.5G`): the one grammar of every size that
//! the command line, the JSON config and partitions accept.

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// What a size may look like, for error messages.
pub const SIZE_SYNTAX: &str = "a number of bytes, or a number with a K, M, G or T suffix \
                               (binary units, decimals allowed), e.g. 4096, 256M, 1.5G";

/// A byte count. A decimal number with an optional binary suffix (`K`, `M`, `G`, `T`, either
/// case): `1.5G` is 1.5 × 2^30 bytes. A fraction of a byte is rounded down, so every size is
/// a whole byte count and `Display` writes one that parses back to the same value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(pub u64);

/// Why a text is not a size.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("the size is empty")]
    Empty,
    #[error("a size cannot be negative")]
    Negative,
    #[error("{0:?} is not a number")]
    NotANumber(String),
    #[error("unknown suffix {0:?}")]
    UnknownSuffix(String),
    #[error("more than 2^64 - 1 bytes")]
    TooLarge,
}

const SUFFIXES: [(char, u32); 4] = [('T', 40), ('G', 30), ('M', 20), ('K', 10)];

impl Size {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for Size {
    type Err = SizeError;

    fn from_str(text: &str) -> Result<Size, SizeError> {
        let t = text.trim();
        if t.is_empty() {
            return Err(SizeError::Empty);
        }
        if t.starts_with('-') {
            return Err(SizeError::Negative);
        }
        let end = t
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(t.len());
        let (number, suffix) = t.split_at(end);
        if number.is_empty() {
            return Err(SizeError::NotANumber(t.to_string()));
        }
        let shift = match suffix {
            "" => 0,
            s => {
                let mut chars = s.chars();
                let c = chars.next().map(|c| c.to_ascii_uppercase());
                match SUFFIXES.iter().find(|(name, _)| Some(*name) == c) {
                    Some((_, shift)) if chars.next().is_none() => *shift,
                    _ => return Err(SizeError::UnknownSuffix(s.to_string())),
                }
            }
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        let digits_only = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits_only(whole) || (number.contains('.') && !digits_only(fraction)) {
            return Err(SizeError::NotANumber(number.to_string()));
        }
        scaled(whole, fraction, shift).map(Size)
    }
}

/// `whole.fraction × 2^shift`, rounded down, computed exactly: the decimal digits are
/// multiplied as a digit string, then the fraction's digits are cut off.
fn scaled(whole: &str, fraction: &str, shift: u32) -> Result<u64, SizeError> {
    let factor = 1u128 << shift;
    let mut product = Vec::with_capacity(whole.len() + fraction.len() + 13);
    let mut carry = 0u128;
    for d in whole.bytes().chain(fraction.bytes()).rev() {
        let x = u128::from(d - b'0') * factor + carry;
        product.push((x % 10) as u8);
        carry = x / 10;
    }
    while carry > 0 {
        product.push((carry % 10) as u8);
        carry /= 10;
    }
    product
        .iter()
        .skip(fraction.len())
        .rev()
        .try_fold(0u64, |n, &d| {
            n.checked_mul(10)
                .and_then(|n| n.checked_add(u64::from(d)))
                .ok_or(SizeError::TooLarge)
        })
}

/// The largest unit in which the size has at most three decimals, so it reads as people
/// write it (`1.5G`, `512M`) and parses back unchanged. Width and alignment are honoured,
/// for tables.
impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&short(self.0))
    }
}

fn short(bytes: u64) -> String {
    let bytes = u128::from(bytes);
    for (suffix, shift) in SUFFIXES {
        let unit = 1u128 << shift;
        if bytes < unit {
            continue;
        }
        for decimals in 0..=3u32 {
            let scale = 10u128.pow(decimals);
            if (bytes * scale) % unit == 0 {
                let v = bytes * scale / unit;
                let (whole, frac) = (v / scale, v % scale);
                return if decimals == 0 {
                    format!("{whole}{suffix}")
                } else {
                    format!("{whole}.{frac:0w$}{suffix}", w = decimals as usize)
                };
            }
        }
    }
    bytes.to_string()
}

/// JSON takes a whole number of bytes or a string in the grammar above.
impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = Size;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(SIZE_SYNTAX)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("invalid size {v}: {}", SizeError::Negative)))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Size, E> {
                Err(E::custom(format!(
                    "invalid size {v}: a number must be a whole number of bytes; write a \
                     fraction as a string with a suffix, e.g. \"1.5G\""
                )))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                v.parse().map_err(|e| {
                    E::custom(format!("invalid size {v:?}: {e}; expected {SIZE_SYNTAX}"))
                })
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(s: &str) -> Result<u64, SizeError> {
        s.parse::<Size>().map(Size::bytes)
    }

    #[test]
    fn sizes_parse_or_say_what_is_wrong() {
        use SizeError::*;
        let cases: [(&str, Result<u64, SizeError>); 27] = [
            ("4096", Ok(4096)),
            ("0", Ok(0)),
            ("512K", Ok(512 << 10)),
            ("256M", Ok(256 << 20)),
            ("2g", Ok(2 << 30)),
            ("1T", Ok(1 << 40)),
            ("1.5G", Ok(3 << 29)),
            (" 1.25m ", Ok(5 << 18)),
            ("0.5K", Ok(512)),
            ("007M", Ok(7 << 20)),
            // Rounded down to a whole byte.
            ("1.0001K", Ok(1024)),
            ("0.3", Ok(0)),
            ("16383.99999999999999999999T", Ok((16384u64 << 40) - 1)),
            ("16777215.99999999999999999999T", Ok(u64::MAX)),
            ("18446744073709551615", Ok(u64::MAX)),
            ("", Err(Empty)),
            ("  ", Err(Empty)),
            ("-1G", Err(Negative)),
            ("12X", Err(UnknownSuffix("X".into()))),
            ("1GB", Err(UnknownSuffix("GB".into()))),
            ("1.5.2G", Err(NotANumber("1.5.2".into()))),
            ("M", Err(NotANumber("M".into()))),
            (".5G", Err(NotANumber(".5".into()))),
            ("1.G", Err(NotANumber("1.".into()))),
            ("lots", Err(NotANumber("lots".into()))),
            ("16777216T", Err(TooLarge)),
            ("18446744073709551616", Err(TooLarge)),
        ];
        for (text, want) in cases {
            assert_eq!(size(text), want, "{text:?}");
        }
    }

    #[test]
    fn display_is_short_and_parses_back() {
        for (bytes, text) in [
            (0, "0"),
            (100, "100"),
            (512 << 20, "512M"),
            (3 << 29, "1.5G"),
            (1 << 40, "1T"),
            (1_000_000_000, "976562.5K"),
            (1025, "1025"),
            (u64::MAX, "18446744073709551615"),
        ] {
            assert_eq!(Size(bytes).to_string(), text);
            assert_eq!(size(text), Ok(bytes));
        }
        assert_eq!(format!("[{:<6}]", Size(512 << 20)), "[512M  ]");
        for bytes in (0..64).map(|i| (1u64 << i) + 3 * i) {
            assert_eq!(size(&Size(bytes).to_string()), Ok(bytes), "{bytes}");
        }
    }

    #[test]
    fn json_takes_byte_counts_and_strings() {
        let v: Vec<Size> = serde_json::from_str(r#"[4096, "1.5G", "64m"]"#).unwrap();
        assert_eq!(v, [Size(4096), Size(3 << 29), Size(64 << 20)]);
        for (json, needle) in [
            ("-1", "cannot be negative"),
            ("1.5", "whole number of bytes"),
            ("\"lots\"", "invalid size \"lots\""),
            ("true", "a number of bytes"),
        ] {
            let e = serde_json::from_str::<Size>(json).unwrap_err().to_string();
            assert!(e.contains(needle), "{json}: {e}");
        }
    }
}

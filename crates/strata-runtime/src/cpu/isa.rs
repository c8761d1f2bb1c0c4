//! Which x86 instruction-set level the CPU kernels may use: the best this CPU has, or a lower cap
//! from `STRATA_CPU_ISA` (`avx2`, `scalar`), to run and measure the AVX2 paths on an AVX-512 CPU.

use std::sync::OnceLock;

/// A kernel build's instruction-set level, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaLevel {
    Scalar,
    Avx2,
    Avx512Vnni,
}

/// The variable that caps the level.
pub const ISA_ENV: &str = "STRATA_CPU_ISA";

impl IsaLevel {
    /// The name kernels report (`DotKernel::isa`) and `STRATA_CPU_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Scalar => "scalar",
            IsaLevel::Avx2 => "avx2",
            IsaLevel::Avx512Vnni => "avx512vnni",
        }
    }

    /// A level by its name; `auto` (or nothing) means no cap.
    pub fn parse_cap(value: &str) -> Result<Option<IsaLevel>, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "scalar" => Ok(Some(IsaLevel::Scalar)),
            "avx2" => Ok(Some(IsaLevel::Avx2)),
            "avx512vnni" | "avx512" => Ok(Some(IsaLevel::Avx512Vnni)),
            other => Err(format!(
                "{ISA_ENV}={other:?} is not a level; use auto, avx512vnni, avx2 or scalar"
            )),
        }
    }
}

/// The cap `STRATA_CPU_ISA` sets, or why its value is not one (the CLI refuses it at start).
pub fn isa_cap_from_env() -> Result<Option<IsaLevel>, String> {
    IsaLevel::parse_cap(&std::env::var(ISA_ENV).unwrap_or_default())
}

/// The cap in force, read once; a value that does not parse sets none.
pub fn isa_cap() -> Option<IsaLevel> {
    static CAP: OnceLock<Option<IsaLevel>> = OnceLock::new();
    *CAP.get_or_init(|| isa_cap_from_env().unwrap_or(None))
}

/// Whether kernels of `level` may run under `cap` (the CPU's own features are checked apart).
pub fn allowed_under(level: IsaLevel, cap: Option<IsaLevel>) -> bool {
    cap.is_none_or(|c| level <= c)
}

/// Whether kernels of `level` may run under the cap in force.
pub fn allows(level: IsaLevel) -> bool {
    allowed_under(level, isa_cap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_parse_and_order() {
        assert_eq!(IsaLevel::parse_cap("auto"), Ok(None));
        assert_eq!(IsaLevel::parse_cap(""), Ok(None));
        assert_eq!(IsaLevel::parse_cap("AVX2"), Ok(Some(IsaLevel::Avx2)));
        assert_eq!(IsaLevel::parse_cap("scalar"), Ok(Some(IsaLevel::Scalar)));
        assert_eq!(IsaLevel::parse_cap("avx512vnni"), Ok(Some(IsaLevel::Avx512Vnni)));
        let e = IsaLevel::parse_cap("sse9").unwrap_err();
        assert!(e.contains("STRATA_CPU_ISA") && e.contains("avx2"), "{e}");
        assert!(allowed_under(IsaLevel::Avx512Vnni, None));
        assert!(!allowed_under(IsaLevel::Avx512Vnni, Some(IsaLevel::Avx2)));
        assert!(allowed_under(IsaLevel::Avx2, Some(IsaLevel::Avx2)));
        assert!(!allowed_under(IsaLevel::Avx2, Some(IsaLevel::Scalar)));
        assert!(allowed_under(IsaLevel::Scalar, Some(IsaLevel::Scalar)));
    }
}

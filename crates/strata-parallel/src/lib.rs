//! strata-parallel: the GPUs and the wires between them, and the plan for spreading a model over them.
//! Topology (NVML discovery, JSON fixtures, optional measurement) feeds the TP x PP planner.

pub mod cost;
#[cfg(feature = "cuda")]
pub mod measure;
pub mod model_shape;
pub mod nvml;
pub mod plan_report;
pub mod planner;
pub mod topology;

pub use model_shape::ModelShape;
pub use planner::{plan, ForcedLayout, OverrideFlags, Plan, PlanError, SplitMode, Targets};
pub use topology::Topology;

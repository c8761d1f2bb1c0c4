//! strata-parallel: the GPUs and the wires between them, the plan for spreading a model over them,
//! and (feature `cuda`) the executors that run it so. Topology feeds the TP x PP planner.

pub mod cost;
#[cfg(feature = "cuda")]
pub mod executors;
pub mod layout;
#[cfg(feature = "cuda")]
pub mod measure;
pub mod model_shape;
pub mod nvml;
pub mod plan_report;
pub mod planner;
pub mod topology;

#[cfg(feature = "cuda")]
pub use executors::ParallelExecutor;
pub use layout::ParallelLayout;
pub use model_shape::ModelShape;
pub use planner::{plan, ForcedLayout, OverrideFlags, Plan, PlanError, SplitMode, Targets};
pub use topology::Topology;

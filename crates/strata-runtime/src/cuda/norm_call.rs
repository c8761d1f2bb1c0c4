//! One row-wise call of norm.cu (RMSNorm alone, after the residual add, of gathered rows, or the
//! residual add alone): its arguments in the kernels' order and its launch shape.

use std::ffi::c_void;

use crate::kernel_args;

/// Threads of the row-wise kernels (norm.cu holds a row of up to 16 values a thread in
/// registers, so a row is at most 16 * ROW_THREADS wide); embedding.cu's lookup uses it too.
pub const ROW_THREADS: u32 = 1024;

/// What the call computes over each row of the f32 residual stream `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormOp {
    /// `out = rms_norm(x) * weight` (`rms_norm`).
    Norm,
    /// `x += delta`, then `out = rms_norm(x) * weight` (`add_rms_norm`); `delta` is f32 like `x`:
    /// `splits` arrays of `[rows, n]` one after the other, added in order (1: `delta` itself;
    /// more: the partial sums of a quantized GEMM that split k, summed here instead of by
    /// `qgemm_reduce`).
    AddNorm { delta: u64, splits: i32 },
    /// `x += delta` alone (`add_residual`, which has no f32 twin: `x` is f32 either way), `delta`
    /// as AddNorm's; `weight`, `out` and `eps` are not passed.
    Add { delta: u64, splits: i32 },
    /// `out[i] = rms_norm(x[row_ids[i]]) * weight` (`rms_norm_rows`): the final norm of the rows
    /// with logits; `row_ids` holds `rows` i32.
    Gather { row_ids: u64 },
}

/// The device pointers and sizes of one call over `rows` rows of `n` values.
#[derive(Debug, Clone, Copy)]
pub struct NormCall {
    pub op: NormOp,
    /// `[rows, n]` f32 residual stream (written back by the adds).
    pub x: u64,
    /// f32 `[n]` norm weight, or 0 for none (the layers' norms, folded into the matrices).
    pub weight: u64,
    /// `[rows, n]` output: bf16, or f32 under `float32`.
    pub out: u64,
    /// Values a row: a multiple of 4, at most `16 * ROW_THREADS`.
    pub n: i32,
    pub eps: f32,
    pub rows: usize,
    /// The `*_f32` twin (`--dtype float32`: f32 output).
    pub float32: bool,
    /// Norm and AddNorm in bf16 (`*_fp8`): the rows also as E4M3 `[rows, n]` and their f32
    /// scales `[rows]`, the FP8 GEMM's input (`fp8_quantize_rows` fused); other ops ignore it.
    pub fp8: Option<(u64, u64)>,
}

impl NormCall {
    /// The kernel that computes `op` for the call's output type.
    pub fn name(&self) -> &'static str {
        match (self.op, self.float32) {
            (NormOp::Norm, false) if self.fp8.is_some() => "rms_norm_fp8",
            (NormOp::AddNorm { .. }, false) if self.fp8.is_some() => "add_rms_norm_fp8",
            (NormOp::Norm, false) => "rms_norm",
            (NormOp::Norm, true) => "rms_norm_f32",
            (NormOp::AddNorm { .. }, false) => "add_rms_norm",
            (NormOp::AddNorm { .. }, true) => "add_rms_norm_f32",
            (NormOp::Add { .. }, _) => "add_residual",
            (NormOp::Gather { .. }, false) => "rms_norm_rows",
            (NormOp::Gather { .. }, true) => "rms_norm_rows_f32",
        }
    }

    /// One block a row.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.rows as u32, 1, 1), ROW_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        let fp8 = self.fp8.as_ref().filter(|_| !self.float32);
        match (&self.op, fp8) {
            (NormOp::Norm, Some((q, q_scales))) => {
                kernel_args!(self.x, self.weight, self.out, self.n, self.eps, *q, *q_scales).to_vec()
            }
            (NormOp::AddNorm { delta, splits }, Some((q, q_scales))) => kernel_args!(
                self.x,
                *delta,
                *splits,
                self.weight,
                self.out,
                self.n,
                self.eps,
                *q,
                *q_scales
            )
            .to_vec(),
            (NormOp::Norm, None) => kernel_args!(self.x, self.weight, self.out, self.n, self.eps).to_vec(),
            (NormOp::AddNorm { delta, splits }, None) => {
                kernel_args!(self.x, *delta, *splits, self.weight, self.out, self.n, self.eps).to_vec()
            }
            (NormOp::Add { delta, splits }, _) => kernel_args!(self.x, *delta, *splits, self.n).to_vec(),
            (NormOp::Gather { row_ids }, _) => {
                kernel_args!(self.x, *row_ids, self.weight, self.out, self.n, self.eps).to_vec()
            }
        }
    }

    one_kernel_launch!("norm.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    fn call(op: NormOp, float32: bool) -> NormCall {
        NormCall {
            op,
            x: 1,
            weight: 2,
            out: 3,
            n: 4,
            eps: 5.0,
            rows: 6,
            float32,
            fp8: None,
        }
    }

    /// An AddNorm call's arguments in norm.cu's order, before any FP8 outputs.
    fn add_norm_args(c: &NormCall) -> Vec<*mut c_void> {
        let NormOp::AddNorm { delta, splits } = &c.op else {
            unreachable!()
        };
        vec![
            at(&c.x),
            at(delta),
            at(splits),
            at(&c.weight),
            at(&c.out),
            at(&c.n),
            at(&c.eps),
        ]
    }

    #[test]
    fn the_arguments_come_in_norm_cu_order() {
        let c = call(NormOp::Norm, false);
        assert_eq!(
            c.args(),
            vec![at(&c.x), at(&c.weight), at(&c.out), at(&c.n), at(&c.eps)]
        );
        assert_eq!((c.name(), c.shape()), ("rms_norm", ((6, 1, 1), 1024, 0)));

        let c = call(NormOp::AddNorm { delta: 7, splits: 3 }, true);
        assert_eq!(c.args(), add_norm_args(&c));
        assert_eq!((c.name(), c.shape()), ("add_rms_norm_f32", ((6, 1, 1), 1024, 0)));

        let c = call(NormOp::Add { delta: 7, splits: 2 }, true);
        let NormOp::Add { delta, splits } = &c.op else {
            unreachable!()
        };
        assert_eq!(c.args(), vec![at(&c.x), at(delta), at(splits), at(&c.n)]);
        assert_eq!(c.name(), "add_residual");

        let c = call(NormOp::Gather { row_ids: 8 }, false);
        let NormOp::Gather { row_ids } = &c.op else {
            unreachable!()
        };
        assert_eq!(
            c.args(),
            vec![at(&c.x), at(row_ids), at(&c.weight), at(&c.out), at(&c.n), at(&c.eps)]
        );
        assert_eq!((c.name(), c.shape()), ("rms_norm_rows", ((6, 1, 1), 1024, 0)));
    }

    #[test]
    fn the_fp8_norms_append_their_outputs() {
        let c = NormCall {
            fp8: Some((9, 10)),
            ..call(NormOp::Norm, false)
        };
        let (q, q_scales) = c.fp8.as_ref().unwrap();
        let want = vec![
            at(&c.x),
            at(&c.weight),
            at(&c.out),
            at(&c.n),
            at(&c.eps),
            at(q),
            at(q_scales),
        ];
        assert_eq!((c.name(), c.args()), ("rms_norm_fp8", want));
        let c = NormCall {
            fp8: Some((9, 10)),
            ..call(NormOp::AddNorm { delta: 7, splits: 1 }, false)
        };
        let (q, q_scales) = c.fp8.as_ref().unwrap();
        let mut want = add_norm_args(&c);
        want.extend([at(q), at(q_scales)]);
        assert_eq!((c.name(), c.args()), ("add_rms_norm_fp8", want));
        // The f32 twins and the other ops have no FP8 outputs.
        for (op, float32, name, args) in [
            (NormOp::AddNorm { delta: 7, splits: 1 }, true, "add_rms_norm_f32", 7),
            (NormOp::Gather { row_ids: 8 }, false, "rms_norm_rows", 6),
        ] {
            let c = NormCall {
                fp8: Some((9, 10)),
                ..call(op, float32)
            };
            assert_eq!((c.name(), c.args().len()), (name, args));
        }
    }

    #[test]
    fn each_op_names_its_twin() {
        let names = |float32| {
            [
                NormOp::Norm,
                NormOp::AddNorm { delta: 0, splits: 1 },
                NormOp::Add { delta: 0, splits: 1 },
                NormOp::Gather { row_ids: 0 },
            ]
            .map(|op| call(op, float32).name())
        };
        assert_eq!(
            names(false),
            ["rms_norm", "add_rms_norm", "add_residual", "rms_norm_rows"]
        );
        assert_eq!(
            names(true),
            ["rms_norm_f32", "add_rms_norm_f32", "add_residual", "rms_norm_rows_f32"]
        );
    }

    #[test]
    fn no_rows_launch_nothing() {
        let mut launched = 0;
        call(NormOp::Norm, false)
            .launch_with(|_, _, _, _, _| {
                launched += 1;
                Ok::<(), ()>(())
            })
            .unwrap();
        let empty = NormCall {
            rows: 0,
            ..call(NormOp::Norm, false)
        };
        empty
            .launch_with(|_, _, _, _, _| {
                launched += 1;
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(launched, 1);
    }
}

//! Decode steps as CUDA graphs: the bucket a step of n sequences is padded to, and the capture
//! (on first use) and launch of each bucket's graph, with or without its logits.

use strata_runtime::cuda::CudaError;

use super::forward::GpuTransformer;

impl GpuTransformer {
    /// Queues a decode step padded to bucket `b` (its inputs uploaded): its layers and, on the last
    /// stage, its logits rows and their argmax, as the bucket's CUDA graph (captured on first use)
    /// or kernel by kernel. With `adjusted` rows the graph stops before the logits, which follow
    /// ([`Self::adjusted_logits`]) once the host's masks, computed while the layers run, are in.
    pub(super) fn run_decode(&mut self, b: usize, adjusted: bool) -> Result<(), CudaError> {
        let parts = self.attention_parts(b);
        let logits_in_graph = self.shard.is_last_stage() && !adjusted;
        let step = |m: &mut Self| {
            m.layers(b, parts)?;
            if logits_in_graph {
                m.logits_chunk(0, b, false)?;
            }
            Ok(())
        };
        if !self.use_graphs {
            return step(self);
        }
        let key = (b, logits_in_graph);
        if !self.graphs.contains_key(&key) {
            self.gpu.begin_capture()?;
            self.capturing = true;
            let run = step(self);
            self.capturing = false;
            let graph = self.gpu.end_capture();
            run?;
            self.graphs.insert(key, graph?);
        }
        // Profiled: the graph's GPU time, against the step's wall time.
        let timer = self.profile_start()?;
        self.graphs[&key].launch()?;
        self.profile_end(timer, || "the whole step's CUDA graph".to_string())
    }
}

/// The padded batch size a decode step of `n` sequences runs as a graph: powers of two up to 8,
/// then multiples of 8 up to 64, then of 32, and never more than `max` (`--max-num-seqs`, which
/// is then a bucket of its own); `None` past `max`.
pub fn graph_bucket(n: usize, max: usize) -> Option<usize> {
    if n > max {
        return None;
    }
    let b = if n <= 8 {
        n.next_power_of_two()
    } else if n <= 64 {
        n.next_multiple_of(8)
    } else {
        n.next_multiple_of(32)
    };
    Some(b.min(max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_then_multiples_of_8_then_of_32() {
        let got: Vec<_> = [1, 3, 5, 8, 9, 17, 64, 65, 100, 256]
            .map(|n| graph_bucket(n, 256))
            .to_vec();
        let want = [1, 4, 8, 8, 16, 24, 64, 96, 128, 256].map(Some).to_vec();
        assert_eq!(got, want);
        assert_eq!(graph_bucket(65, 64), None);
        // A --max-num-seqs between buckets is the last bucket: 17-20 sequences of 20 ran
        // unpadded and failed to start as an overlapped step before.
        assert_eq!(graph_bucket(17, 20), Some(20));
        assert_eq!(graph_bucket(16, 20), Some(16));
        assert_eq!(graph_bucket(21, 20), None);
        for max in 1..=300 {
            for n in 1..=max {
                let b = graph_bucket(n, max).unwrap();
                assert!(n <= b && b <= max, "{n} of {max}: bucket {b}");
            }
        }
    }
}

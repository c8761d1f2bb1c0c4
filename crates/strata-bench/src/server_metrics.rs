//! Figures a server exposes on its Prometheus `/metrics`, read before and after a run: speculative
//! decoding's draft tokens proposed and accepted (strata's `strata_spec_decode_*`, vLLM's
//! `vllm:spec_decode_*`) and sequences preempted for KV space (`strata_preemptions_total`,
//! `vllm:num_preemptions_total`).

use serde::{Deserialize, Serialize};

use crate::config::BenchConfig;

/// Speculative decoding during one run, from the server's counters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeculationSummary {
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    /// accepted / draft tokens.
    pub acceptance_rate: f64,
    /// Accepted over proposed by position in the draft (0 = first), where the server gives them.
    pub acceptance_by_position: Vec<f64>,
}

/// The counters of one scrape: draft tokens in all and, by position, proposed and accepted; and
/// preemptions, where the server counts them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServerCounters {
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    pub draft_by_position: Vec<f64>,
    pub accepted_by_position: Vec<f64>,
    pub preemptions: Option<f64>,
}

/// Reads `/metrics`; `None` when the server has none or exposes none of these counters.
pub async fn scrape(cfg: &BenchConfig, client: &reqwest::Client) -> Option<ServerCounters> {
    let response = client.get(cfg.url("/metrics")).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    parse(&response.text().await.ok()?)
}

/// The draft and preemption counters in a Prometheus text exposition, if it has any.
pub fn parse(text: &str) -> Option<ServerCounters> {
    let mut c = ServerCounters::default();
    let mut found = false;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let (name, labels) = match key.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (key, ""),
        };
        let name = name
            .strip_prefix("strata_")
            .or_else(|| name.strip_prefix("vllm:"))
            .unwrap_or("");
        let position = || {
            labels
                .split(',')
                .find_map(|l| l.trim().strip_prefix("position="))
                .and_then(|p| p.trim_matches('"').parse::<usize>().ok())
        };
        let slot = |v: &mut Vec<f64>, at: usize| {
            if v.len() <= at {
                v.resize(at + 1, 0.0);
            }
            v[at] += value;
        };
        match name {
            "spec_decode_num_draft_tokens_total" => c.draft_tokens += value,
            "spec_decode_num_accepted_tokens_total" => c.accepted_tokens += value,
            "spec_decode_num_draft_tokens_per_pos" | "spec_decode_num_draft_tokens_per_pos_total" => {
                if let Some(at) = position() {
                    slot(&mut c.draft_by_position, at)
                }
            }
            "spec_decode_num_accepted_tokens_per_pos" | "spec_decode_num_accepted_tokens_per_pos_total" => {
                if let Some(at) = position() {
                    slot(&mut c.accepted_by_position, at)
                }
            }
            "preemptions_total" | "num_preemptions_total" => *c.preemptions.get_or_insert(0.0) += value,
            _ => continue,
        }
        found = true;
    }
    found.then_some(c)
}

/// Sequences preempted between two scrapes, where the server counts them.
pub fn preemptions_between(before: &ServerCounters, after: &ServerCounters) -> Option<f64> {
    Some(after.preemptions? - before.preemptions?)
}

/// What happened between two scrapes; `None` when no draft was proposed in between.
pub fn summarize(before: &ServerCounters, after: &ServerCounters) -> Option<SpeculationSummary> {
    let draft_tokens = after.draft_tokens - before.draft_tokens;
    if draft_tokens <= 0.0 {
        return None;
    }
    let accepted_tokens = after.accepted_tokens - before.accepted_tokens;
    let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
    let acceptance_by_position = (0..after.draft_by_position.len())
        .map(|i| {
            let proposed = at(&after.draft_by_position, i) - at(&before.draft_by_position, i);
            let accepted = at(&after.accepted_by_position, i) - at(&before.accepted_by_position, i);
            if proposed > 0.0 {
                accepted / proposed
            } else {
                0.0
            }
        })
        .collect();
    Some(SpeculationSummary {
        draft_tokens,
        accepted_tokens,
        acceptance_rate: accepted_tokens / draft_tokens,
        acceptance_by_position,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_strata_and_vllm_counters_and_takes_the_difference() {
        let before = parse(
            "# HELP strata_spec_decode_num_draft_tokens_total x\n\
             strata_spec_decode_num_draft_tokens_total 10\n\
             strata_spec_decode_num_accepted_tokens_total 4\n\
             strata_spec_decode_num_draft_tokens_per_pos{position=\"0\"} 5\n\
             strata_spec_decode_num_draft_tokens_per_pos{position=\"1\"} 5\n\
             strata_spec_decode_num_accepted_tokens_per_pos{position=\"0\"} 3\n\
             strata_spec_decode_num_accepted_tokens_per_pos{position=\"1\"} 1\n\
             strata_kv_blocks_used 3\n",
        )
        .expect("has draft counters");
        let after = parse(
            "strata_spec_decode_num_draft_tokens_total 30\n\
             strata_spec_decode_num_accepted_tokens_total 19\n\
             strata_spec_decode_num_draft_tokens_per_pos{position=\"0\"} 15\n\
             strata_spec_decode_num_draft_tokens_per_pos{position=\"1\"} 15\n\
             strata_spec_decode_num_accepted_tokens_per_pos{position=\"0\"} 13\n\
             strata_spec_decode_num_accepted_tokens_per_pos{position=\"1\"} 6\n",
        )
        .expect("has draft counters");
        let s = summarize(&before, &after).expect("drafts in between");
        assert_eq!((s.draft_tokens, s.accepted_tokens), (20.0, 15.0));
        assert!((s.acceptance_rate - 0.75).abs() < 1e-12);
        assert_eq!(s.acceptance_by_position, [1.0, 0.5]);
        assert!(summarize(&after, &after).is_none(), "no drafts, no figure");
        let vllm = parse(
            "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 8\n\
             vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 6\n",
        )
        .expect("vLLM's names");
        assert_eq!((vllm.draft_tokens, vllm.accepted_tokens), (8.0, 6.0));
        assert!(parse("strata_kv_blocks_used 3\n").is_none());
        assert_eq!(preemptions_between(&before, &after), None, "no preemption counter");
    }

    #[test]
    fn counts_preemptions_between_scrapes() {
        let before = parse("strata_preemptions_total 2\nstrata_kv_blocks_used 3\n").expect("a preemption counter");
        let after = parse("strata_preemptions_total 9\n").expect("a preemption counter");
        assert_eq!(preemptions_between(&before, &after), Some(7.0));
        assert!(summarize(&before, &after).is_none(), "no drafts, no speculation figure");
        let vllm = parse("vllm:num_preemptions_total{model_name=\"m\"} 4\n").expect("vLLM's name");
        assert_eq!(vllm.preemptions, Some(4.0));
    }
}

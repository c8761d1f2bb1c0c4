//! Property test of the KV block manager: random add / step / finish / abort sequences with
//! shared prefixes, checking after every step that no block leaks, none is freed twice, shared
//! blocks are never written, rejected draft tokens give their blocks back, and everything returns
//! when all sequences are gone.

use proptest::prelude::*;
use strata_engine::block_manager::{BlockManager, BlockTable};

#[derive(Debug, Clone)]
enum Op {
    Add(Vec<u32>),
    Step(usize, u32),
    /// Sequence `.0` verifies `.1` draft tokens and accepts the first `.2` of them.
    Speculate(usize, usize, usize),
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Tokens from a tiny alphabet, so prompts share prefixes often.
        3 => prop::collection::vec(0u32..3, 1..40).prop_map(Op::Add),
        6 => (any::<usize>(), 0u32..3).prop_map(|(i, t)| Op::Step(i, t)),
        3 => (any::<usize>(), 1usize..9, 0usize..9).prop_map(|(i, k, a)| Op::Speculate(i, k, a.min(k))),
        2 => any::<usize>().prop_map(Op::Finish),
    ]
}

struct Seq {
    table: BlockTable,
    tokens: Vec<u32>,
}

/// Every write the engine would do for positions `from..to` must land in an unshared block.
fn write_positions(bm: &BlockManager, seq: &Seq, from: usize, to: usize) -> Result<(), TestCaseError> {
    for pos in from..to {
        let id = bm.block_for_write(&seq.table, pos);
        prop_assert_eq!(
            bm.ref_count(id),
            1,
            "write at position {} into shared block {}",
            pos,
            id
        );
    }
    Ok(())
}

fn check(bm: &BlockManager, seqs: &[Seq]) -> Result<(), TestCaseError> {
    bm.check_invariants().map_err(TestCaseError::fail)?;
    let mut refs = vec![0u32; bm.num_blocks()];
    for s in seqs {
        for &b in s.table.ids() {
            refs[b as usize] += 1;
        }
        prop_assert!(s.table.ids().len() * bm.block_size() >= s.table.num_tokens);
    }
    for (b, &r) in refs.iter().enumerate() {
        prop_assert_eq!(bm.ref_count(b as u32), r, "block {} reference count", b);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn block_bookkeeping_survives_any_schedule(ops in prop::collection::vec(op(), 1..200), caching in any::<bool>()) {
        let mut bm = BlockManager::new(24, 4, caching);
        let mut seqs: Vec<Seq> = Vec::new();
        let mut hits = 0;
        for op in ops {
            match op {
                Op::Add(prompt) => match bm.allocate_prompt(&prompt) {
                    Ok((table, cached)) => {
                        prop_assert!(cached < prompt.len(), "the last prompt token is always computed");
                        hits += cached;
                        let mut s = Seq { table, tokens: prompt };
                        write_positions(&bm, &s, cached, s.tokens.len())?;
                        bm.commit_full_blocks(&mut s.table, &s.tokens);
                        seqs.push(s);
                    }
                    Err(e) => prop_assert!(e.needed > e.available),
                },
                Op::Step(i, tok) if !seqs.is_empty() => {
                    let i = i % seqs.len();
                    let before = seqs[i].table.clone();
                    if bm.grow(&mut seqs[i].table, 1).is_ok() {
                        let s = &mut seqs[i];
                        s.tokens.push(tok);
                        let pos = s.tokens.len() - 1;
                        write_positions(&bm, s, pos, pos + 1)?;
                        bm.commit_full_blocks(&mut s.table, &s.tokens);
                    } else {
                        prop_assert_eq!(&seqs[i].table, &before, "a failed grow changes nothing");
                        // Preempt (recompute later): free its blocks.
                        let mut s = seqs.swap_remove(i);
                        bm.free_table(&mut s.table);
                    }
                }
                Op::Speculate(i, drafts, accepted) if !seqs.is_empty() => {
                    let i = i % seqs.len();
                    let before = seqs[i].table.clone();
                    if bm.grow(&mut seqs[i].table, drafts).is_ok() {
                        let s = &mut seqs[i];
                        let len = s.tokens.len();
                        write_positions(&bm, s, len, len + drafts)?;
                        s.tokens.extend((0..accepted as u32).map(|t| t % 3));
                        bm.truncate(&mut s.table, s.tokens.len());
                        prop_assert_eq!(s.table.num_tokens, s.tokens.len());
                        prop_assert_eq!(s.table.ids().len(), s.tokens.len().div_ceil(bm.block_size()));
                        bm.commit_full_blocks(&mut s.table, &s.tokens);
                    } else {
                        prop_assert_eq!(&seqs[i].table, &before, "a failed grow changes nothing");
                    }
                }
                Op::Finish(i) if !seqs.is_empty() => {
                    let mut s = seqs.swap_remove(i % seqs.len());
                    bm.free_table(&mut s.table);
                }
                _ => {}
            }
            check(&bm, &seqs)?;
        }
        for mut s in seqs.drain(..) {
            bm.free_table(&mut s.table);
        }
        check(&bm, &seqs)?;
        prop_assert_eq!(bm.num_available(), bm.num_blocks());
        if !caching {
            prop_assert_eq!(hits, 0);
        }
    }
}

#[test]
fn shared_prefix_is_reused_and_evicted_last_used_first() {
    let mut bm = BlockManager::new(8, 4, true);
    let prompt: Vec<u32> = (0..10).collect();
    let (mut a, cached) = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(cached, 0);
    bm.commit_full_blocks(&mut a, &prompt);
    // Same 8-token prefix: two full blocks come from the cache.
    let (mut b, cached) = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(cached, 8);
    assert_eq!(a.ids()[..2], b.ids()[..2]);
    assert_ne!(a.ids()[2], b.ids()[2]);
    assert_eq!(bm.ref_count(a.ids()[0]), 2);
    // Lookups stop at the first miss: 1 miss for the first prompt, 2 hits for the second.
    assert!(
        (bm.prefix_hit_rate() - 2.0 / 3.0).abs() < 1e-9,
        "{}",
        bm.prefix_hit_rate()
    );
    bm.free_table(&mut a);
    bm.free_table(&mut b);
    // Freed but cached: a third request still hits.
    let (mut c, cached) = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(cached, 8);
    bm.free_table(&mut c);
    // Filling the cache with other content evicts the cached blocks.
    let other: Vec<u32> = (100..132).collect();
    let (mut d, _) = bm.allocate_prompt(&other).unwrap();
    assert_eq!(d.ids().len(), 8);
    bm.free_table(&mut d);
    let (_, cached) = bm.allocate_prompt(&prompt).unwrap();
    assert_eq!(cached, 0, "the old prefix was evicted");
}

//! Mutation strategies: byte edits biased towards the parts of a file a parser reads first
//! (headers, counts, lengths), and structural edits of JSON documents (numbers, types, keys).

use std::ops::Range;
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::Value;

/// One edit of a byte image. Positions past the end are taken modulo the current length.
#[derive(Debug, Clone)]
pub enum ByteMutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    SetByte {
        at: usize,
        byte: u8,
    },
    /// Overwrite with (the first bytes of) a little-endian integer such as a count or length.
    Overwrite {
        at: usize,
        bytes: Vec<u8>,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    Truncate {
        len: usize,
    },
}

impl ByteMutation {
    pub fn apply(&self, image: &mut Vec<u8>) {
        let pos = |at: usize, len: usize| if len == 0 { 0 } else { at % len };
        match self {
            ByteMutation::FlipBit { at, bit } if !image.is_empty() => {
                let i = pos(*at, image.len());
                image[i] ^= 1 << bit;
            }
            ByteMutation::SetByte { at, byte } if !image.is_empty() => {
                let i = pos(*at, image.len());
                image[i] = *byte;
            }
            ByteMutation::Overwrite { at, bytes } => {
                let i = pos(*at, image.len());
                let end = (i + bytes.len()).min(image.len());
                image[i..end].copy_from_slice(&bytes[..end - i]);
            }
            ByteMutation::Insert { at, bytes } => {
                let i = pos(*at, image.len() + 1);
                image.splice(i..i, bytes.iter().copied());
            }
            ByteMutation::Remove { at, len } => {
                let i = pos(*at, image.len());
                let end = (i + len).min(image.len());
                image.drain(i..end);
            }
            ByteMutation::Truncate { len } => image.truncate(*len),
            _ => {}
        }
    }
}

/// Integers a corrupt count, length, type id or offset is likely to hold, 1 to 8 bytes wide.
pub fn interesting_integer() -> impl Strategy<Value = Vec<u8>> {
    let value = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(5),
        Just(31),
        Just(32),
        Just(1 << 31),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 60),
        Just(u64::MAX),
        Just(u64::MAX - 31),
        any::<u64>(),
    ];
    (value, prop_oneof![Just(1usize), Just(2), Just(4), Just(8)])
        .prop_map(|(v, width)| v.to_le_bytes()[..width].to_vec())
}

/// One to four byte edits of `base`, at positions drawn mostly from `hot` (the regions a parser
/// reads counts and lengths from) and sometimes anywhere.
pub fn byte_mutations(base_len: usize, hot: &[Range<usize>]) -> BoxedStrategy<Vec<ByteMutation>> {
    let anywhere = 0..base_len.max(1);
    let mut positions: Vec<(u32, BoxedStrategy<usize>)> = hot
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| (8 / hot.len().max(1) as u32 + 1, r.clone().boxed()))
        .collect();
    positions.push((1, anywhere.clone().boxed()));
    let position = proptest::strategy::Union::new_weighted(positions).boxed();
    let byte = prop_oneof![Just(0x00u8), Just(0xFF), any::<u8>()];
    let truncate_len = prop_oneof![
        2 => hot.iter().map(|r| r.end).max().unwrap_or(0)..base_len + 1,
        1 => 0..base_len + 1,
    ];
    let one = prop_oneof![
        3 => (position.clone(), 0..8u8).prop_map(|(at, bit)| ByteMutation::FlipBit { at, bit }),
        3 => (position.clone(), byte).prop_map(|(at, byte)| ByteMutation::SetByte { at, byte }),
        3 => (position.clone(), interesting_integer()).prop_map(|(at, bytes)| ByteMutation::Overwrite { at, bytes }),
        1 => (position.clone(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| ByteMutation::Insert { at, bytes }),
        1 => (position, 1..16usize).prop_map(|(at, len)| ByteMutation::Remove { at, len }),
        1 => truncate_len.prop_map(|len| ByteMutation::Truncate { len }),
    ];
    proptest::collection::vec(one, 1..=4).boxed()
}

/// Copies of `base` with byte edits from [`byte_mutations`].
pub fn mutated(base: Arc<Vec<u8>>, hot: &[Range<usize>]) -> BoxedStrategy<Vec<u8>> {
    byte_mutations(base.len(), hot)
        .prop_map(move |edits| {
            let mut image = base.to_vec();
            for e in &edits {
                e.apply(&mut image);
            }
            image
        })
        .boxed()
}

/// One structural edit of a JSON document, at the node `at` (modulo the number of nodes, in
/// depth-first order; node 0 is the whole document).
#[derive(Debug, Clone)]
pub enum JsonEdit {
    Replace {
        at: usize,
        with: Value,
    },
    /// Removes the node from its object or array.
    Remove {
        at: usize,
    },
    /// Puts a copy of node `from` in place of node `at` (types and sizes moved elsewhere).
    CopyFrom {
        at: usize,
        from: usize,
    },
    /// Wraps the node in an array (or, with `object`, in an object under its own key `"x"`).
    Wrap {
        at: usize,
        object: bool,
    },
}

impl JsonEdit {
    pub fn apply(&self, doc: &mut Value) {
        let n = count_nodes(doc);
        let at = |i: usize| i % n;
        match self {
            JsonEdit::Replace { at: i, with } => {
                if let Some(node) = node_mut(doc, at(*i)) {
                    *node = with.clone();
                }
            }
            JsonEdit::Remove { at: i } => remove_node(doc, at(*i)),
            JsonEdit::CopyFrom { at: i, from } => {
                let copy = node_mut(doc, at(*from)).map(|v| v.clone());
                if let (Some(copy), Some(node)) = (copy, node_mut(doc, at(*i))) {
                    *node = copy;
                }
            }
            JsonEdit::Wrap { at: i, object } => {
                if let Some(node) = node_mut(doc, at(*i)) {
                    let inner = node.take();
                    *node = if *object {
                        serde_json::json!({ "x": inner })
                    } else {
                        Value::Array(vec![inner])
                    };
                }
            }
        }
    }
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

/// The node `index` in depth-first order.
fn node_mut(v: &mut Value, index: usize) -> Option<&mut Value> {
    if index == 0 {
        return Some(v);
    }
    let mut skip = index - 1;
    let children: Vec<&mut Value> = match v {
        Value::Array(a) => a.iter_mut().collect(),
        Value::Object(o) => o.values_mut().collect(),
        _ => return None,
    };
    for child in children {
        let size = count_nodes(child);
        if skip < size {
            return node_mut(child, skip);
        }
        skip -= size;
    }
    None
}

/// Removes the node `index` (not the root) from its parent.
fn remove_node(v: &mut Value, index: usize) {
    if index == 0 {
        return;
    }
    let mut skip = index - 1;
    match v {
        Value::Array(a) => {
            for i in 0..a.len() {
                let size = count_nodes(&a[i]);
                if skip == 0 {
                    a.remove(i);
                    return;
                }
                if skip < size {
                    return remove_node(&mut a[i], skip);
                }
                skip -= size;
            }
        }
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                let size = count_nodes(&o[&k]);
                if skip == 0 {
                    o.remove(&k);
                    return;
                }
                if skip < size {
                    return remove_node(&mut o[&k], skip);
                }
                skip -= size;
            }
        }
        _ => {}
    }
}

/// JSON values a corrupt or hostile config is likely to hold where a count, flag or name belongs.
fn interesting_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(-1),
            Just(2),
            Just(1 << 31),
            Just(1 << 32),
            Just(1 << 53),
            Just(i64::MAX),
            Just(i64::MIN)
        ]
        .prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        prop_oneof![Just(0.5f64), Just(1e-300), Just(1e300), Just(-1e300), Just(f64::MAX)].prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(Value::Bool(false)),
        prop_oneof![
            Just(""),
            Just("a"),
            Just("<|im_end|>"),
            Just("\u{2581}\u{0120}"),
            Just("llama3")
        ]
        .prop_map(Value::from),
        Just(Value::String("x".repeat(5000))),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([0, 1])),
    ]
}

/// Copies of the JSON document `base` with one to four structural edits, written out; a fifth
/// of them also get byte edits of the text, so the JSON parser's error paths are reached too.
pub fn json_mutated(base: Arc<Value>) -> BoxedStrategy<Vec<u8>> {
    let text_len = base.to_string().len();
    let edit = prop_oneof![
        4 => (any::<usize>(), interesting_json()).prop_map(|(at, with)| JsonEdit::Replace { at, with }),
        2 => any::<usize>().prop_map(|at| JsonEdit::Remove { at }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(at, from)| JsonEdit::CopyFrom { at, from }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(at, object)| JsonEdit::Wrap { at, object }),
    ];
    let bytes = prop_oneof![4 => Just(vec![]), 1 => byte_mutations(text_len, &[])];
    (proptest::collection::vec(edit, 1..=4), bytes)
        .prop_map(move |(edits, byte_edits)| {
            let mut doc = (*base).clone();
            for e in &edits {
                e.apply(&mut doc);
            }
            let mut text = doc.to_string().into_bytes();
            for e in &byte_edits {
                e.apply(&mut text);
            }
            text
        })
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_edits_reach_every_node() {
        let doc = serde_json::json!({"a": [1, {"b": 2}], "c": 3});
        assert_eq!(count_nodes(&doc), 6);
        let mut d = doc.clone();
        JsonEdit::Replace {
            at: 4,
            with: Value::Null,
        }
        .apply(&mut d);
        assert_eq!(d, serde_json::json!({"a": [1, {"b": null}], "c": 3}));
        let mut d = doc.clone();
        JsonEdit::Remove { at: 3 }.apply(&mut d);
        assert_eq!(d, serde_json::json!({"a": [1], "c": 3}));
        let mut d = doc.clone();
        JsonEdit::CopyFrom { at: 5, from: 1 }.apply(&mut d);
        assert_eq!(d["c"], serde_json::json!([1, {"b": 2}]));
        let mut d = doc.clone();
        JsonEdit::Wrap {
            at: 5 + 6,
            object: true,
        }
        .apply(&mut d);
        assert_eq!(d["c"], serde_json::json!({"x": 3}));
    }

    #[test]
    fn byte_mutations_apply_at_any_position() {
        let mut image = vec![0u8; 4];
        ByteMutation::Overwrite {
            at: 6,
            bytes: vec![1, 2, 3],
        }
        .apply(&mut image);
        assert_eq!(image, [0, 0, 1, 2]);
        ByteMutation::Insert { at: 4, bytes: vec![9] }.apply(&mut image);
        assert_eq!(image, [0, 0, 1, 2, 9]);
        ByteMutation::Remove { at: 1, len: 2 }.apply(&mut image);
        assert_eq!(image, [0, 2, 9]);
        ByteMutation::Truncate { len: 1 }.apply(&mut image);
        assert_eq!(image, [0]);
    }
}

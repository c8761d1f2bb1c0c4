//! Fuzzing the request parsers: valid chat, completion and Responses bodies, mutated byte by byte
//! and value by value, through `body::parse_json` and each endpoint's `prepare` (the checks and the
//! prompt building that come before the engine; a Responses body as the chat body it becomes) must
//! give a 4xx error or a request within every limit,
//! never a panic, with memory in proportion to the body. Driven by `strata-fuzz` like the loaders'
//! targets (`make test`: the default cases from seed 0; `make fuzz`: `STRATA_FUZZ_SECONDS` each);
//! bodies that once failed go to `regressions_stay_fixed`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use strata_fuzz::{fuzz, Bounds, CountingAllocator, Outcome, Target};
use strata_model::chat_template::ChatTemplate;
use strata_model::loader::{default_model_path, load_text};
use strata_model::tokenizer::Tokenizer;
use strata_server::body::parse_json;
use strata_server::params::{
    MAX_API_TEMPERATURE, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
};
use strata_server::prompt::{PromptContext, PromptLimit};
use strata_server::protocol::{ChatCompletionRequest, CompletionRequest};
use strata_server::response_format::GrammarCheck;
use strata_server::responses::types::ResponsesRequest;
use strata_server::{chat, completions, responses, ApiError};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const MAX_MODEL_LEN: usize = 1024;
const MAX_QUEUE: usize = 64;
const BODY_LIMIT: usize = 1 << 20;

/// A body parses into a few times its size and its prompt into ids; the chat template renders
/// into a string of its own. Bounded by the body, never by a number written in it.
const REQUEST_BOUNDS: Bounds = Bounds {
    bytes_per_input_byte: 256,
    fixed_bytes: 4 << 20,
    time: Duration::from_secs(2),
};

/// The default model's tokenizer and chat template (no weights).
fn model_text() -> &'static (Tokenizer, ChatTemplate) {
    static TEXT: OnceLock<(Tokenizer, ChatTemplate)> = OnceLock::new();
    TEXT.get_or_init(|| {
        let path = default_model_path();
        assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
        load_text(&path).expect("the default model's tokenizer loads")
    })
}

/// The grammar check of the default model's vocabulary, built once.
fn grammar() -> &'static GrammarCheck {
    static GRAMMAR: OnceLock<GrammarCheck> = OnceLock::new();
    GRAMMAR.get_or_init(|| GrammarCheck::for_tokenizer(&model_text().0))
}

fn context() -> PromptContext<'static> {
    let (tokenizer, template) = model_text();
    PromptContext {
        tokenizer,
        template,
        limit: PromptLimit::new(tokenizer, MAX_MODEL_LEN),
        max_queue: MAX_QUEUE,
        grammar: grammar(),
    }
}

/// Valid bodies the mutations start from.
fn seeds() -> Vec<(Endpoint, Value)> {
    vec![
        (
            Endpoint::Chat,
            json!({"model": "smol", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
        ),
        (
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}, {"role": "user", "content": "c"}],
                "max_completion_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "n": 2,
                "stop": ["\n", "END"], "seed": 7, "logprobs": true, "top_logprobs": 3, "stream": true,
                "stream_options": {"include_usage": true}, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "repetition_penalty": 1.1, "stop_token_ids": [2], "ignore_eos": false, "user": "u"}),
        ),
        (
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": false}),
        ),
        (
            Endpoint::Completion,
            json!({"prompt": "Once upon a time", "max_tokens": 8}),
        ),
        (
            Endpoint::Completion,
            json!({"model": "smol", "prompt": ["a", "b"], "n": 3, "logprobs": 2, "echo": false, "best_of": 3,
                "stop": "x", "temperature": 0, "seed": -1, "stream": false}),
        ),
        (
            Endpoint::Completion,
            json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1}),
        ),
        (Endpoint::Completion, json!({"prompt": [10, 20, 30], "suffix": null})),
        (Endpoint::Responses, json!({"model": "smol", "input": "Hi"})),
        (
            Endpoint::Responses,
            json!({"instructions": "Be brief.", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"role": "developer", "content": "d"}, {"role": "user", "content": "e"}],
                "max_output_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stream": true, "store": false,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": true}},
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": "auto", "parallel_tool_calls": false,
                "metadata": {"k": "v"}, "user": "u", "top_k": 40, "seed": 7, "stop": ["\n"]}),
        ),
        (
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": "Name a city."}], "logit_bias": {"17": -100, "42": 2.5},
                "response_format": {"type": "json_schema", "json_schema": {"name": "city", "strict": true,
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}),
        ),
        (
            Endpoint::Completion,
            json!({"prompt": "JSON:", "max_tokens": 4, "logit_bias": {"0": 1}, "response_format": {"type": "json_object"}}),
        ),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Endpoint {
    Chat,
    Completion,
    Responses,
}

/// Values that probe the edges of every field.
fn interesting_values() -> Vec<Value> {
    vec![
        json!(null),
        json!(true),
        json!(0),
        json!(1),
        json!(-1),
        json!(2),
        json!(21),
        json!(129),
        json!(1025),
        json!(0.5),
        json!(-2.5),
        json!(1e-9),
        json!(1e300),
        json!(-1e300),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(""),
        json!("x"),
        json!("<|im_start|>"),
        json!("\u{0}\u{FFFD}é"),
        json!("a ".repeat(3000)),
        json!([]),
        json!([[]]),
        json!([""]),
        json!([1, 2, 3]),
        json!([u32::MAX]),
        json!(vec![7; 2000]),
        json!(vec!["s"; 40]),
        json!([{"role": "user", "content": "hi"}]),
        json!([{"role": "tool", "content": "hi"}]),
        json!([{"type": "image_url"}]),
        json!({}),
        json!({"include_usage": true}),
        json!({"role": "user"}),
    ]
}

/// Every field the request types document (their OpenAPI schemas are the parsing types').
fn fields() -> &'static [String] {
    static FIELDS: OnceLock<Vec<String>> = OnceLock::new();
    FIELDS.get_or_init(|| {
        let doc: Value = serde_json::from_str(&strata_server::openapi::document_json()).expect("the document is JSON");
        let mut fields: Vec<String> = ["ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"]
            .iter()
            .flat_map(|schema| {
                let properties = doc["components"]["schemas"][schema]["properties"].as_object();
                properties.into_iter().flat_map(|p| p.keys().cloned())
            })
            .collect();
        fields.sort();
        fields.dedup();
        assert!(fields.len() > 20, "{fields:?}");
        fields
    })
}

/// One change to a body.
#[derive(Debug, Clone)]
enum Mutation {
    /// Sets a top-level field to an interesting value.
    SetField(Index, Index),
    /// Replaces any value in the tree with an interesting value.
    ReplaceValue(Index, Index),
    /// Removes a top-level field.
    RemoveField(Index),
    /// Overwrites one byte of the serialized body.
    Byte(Index, u8),
    /// Deletes up to 8 bytes.
    Delete(Index, usize),
    /// Inserts JSON punctuation or a token.
    Insert(Index, Index),
    /// Repeats a span.
    Duplicate(Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), any::<Index>()).prop_map(|(f, v)| Mutation::SetField(f, v)),
        3 => (any::<Index>(), any::<Index>()).prop_map(|(at, v)| Mutation::ReplaceValue(at, v)),
        1 => any::<Index>().prop_map(Mutation::RemoveField),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
        1 => (any::<Index>(), 1..8usize).prop_map(|(at, n)| Mutation::Delete(at, n)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(at, t)| Mutation::Insert(at, t)),
        1 => (any::<Index>(), 1..64usize).prop_map(|(at, n)| Mutation::Duplicate(at, n)),
    ]
}

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\\",
    "null",
    "-",
    "0",
    "1e400",
    "\\ud800",
    "\u{0}",
    " ",
    "9999999999999999999999",
];

/// Every value of the tree, as a path of keys and indexes.
fn paths(v: &Value, at: Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(at.clone());
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let mut p = at.clone();
                p.push(json!(k));
                paths(child, p, out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                let mut p = at.clone();
                p.push(json!(i));
                paths(child, p, out);
            }
        }
        _ => {}
    }
}

fn value_at<'a>(v: &'a mut Value, path: &[Value]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, step| match step {
        Value::String(k) => v.get_mut(k.as_str()),
        Value::Number(i) => v.get_mut(i.as_u64()? as usize),
        _ => None,
    })
}

/// Applies the mutations: value-level ones while the body is still JSON, byte-level ones on its text.
fn mutate(seed: &Value, mutations: &[Mutation]) -> Vec<u8> {
    let values = interesting_values();
    let mut tree = Some(seed.clone());
    let mut bytes = Vec::new();
    for m in mutations {
        if let Some(v) = &mut tree {
            match m {
                Mutation::SetField(f, x) => {
                    if let Some(map) = v.as_object_mut() {
                        map.insert(f.get(fields()).clone(), x.get(&values).clone());
                    }
                    continue;
                }
                Mutation::ReplaceValue(at, x) => {
                    let mut all = Vec::new();
                    paths(v, Vec::new(), &mut all);
                    let path = at.get(&all).clone();
                    if let Some(slot) = value_at(v, &path) {
                        *slot = x.get(&values).clone();
                    }
                    continue;
                }
                Mutation::RemoveField(f) => {
                    if let Some(map) = v.as_object_mut() {
                        map.remove(f.get(fields()));
                    }
                    continue;
                }
                _ => {
                    bytes = v.to_string().into_bytes();
                    tree = None;
                }
            }
        }
        if bytes.is_empty() {
            bytes.push(b' ');
        }
        match m {
            Mutation::Byte(at, b) => {
                let i = at.index(bytes.len());
                bytes[i] = *b;
            }
            Mutation::Delete(at, n) => {
                let i = at.index(bytes.len());
                let end = (i + n).min(bytes.len());
                bytes.drain(i..end);
            }
            Mutation::Insert(at, t) => {
                let i = at.index(bytes.len() + 1);
                let token = t.get(TOKENS).as_bytes();
                bytes.splice(i..i, token.iter().copied());
            }
            Mutation::Duplicate(at, n) => {
                let i = at.index(bytes.len());
                let end = (i + n).min(bytes.len());
                let span = bytes[i..end].to_vec();
                bytes.splice(end..end, span);
            }
            // Value-level mutations on a body that is no longer JSON do nothing.
            _ => {}
        }
    }
    match tree {
        Some(v) => v.to_string().into_bytes(),
        None => bytes,
    }
}

fn client_error(e: &ApiError, body: &[u8]) -> Result<bool, String> {
    if e.status.is_client_error() && !e.message.is_empty() {
        Ok(false)
    } else {
        Err(format!(
            "{} `{}` for {}",
            e.status,
            e.message,
            String::from_utf8_lossy(body)
        ))
    }
}

/// Runs one body through the endpoint's parser and checks: whether it was accepted, or what broke.
fn check(endpoint: Endpoint, body: &[u8]) -> Result<bool, String> {
    let ctx = context();
    let bytes = Ok(Bytes::copy_from_slice(body));
    let prepared = match endpoint {
        Endpoint::Chat => parse_json::<ChatCompletionRequest>(bytes, BODY_LIMIT)
            .and_then(|req| chat::prepare(&req, &ctx))
            .map(|(prompt, plan)| (vec![prompt], plan)),
        Endpoint::Completion => {
            parse_json::<CompletionRequest>(bytes, BODY_LIMIT).and_then(|req| completions::prepare(&req, &ctx))
        }
        Endpoint::Responses => parse_json::<ResponsesRequest>(bytes, BODY_LIMIT)
            .and_then(|req| responses::chat_body(&req))
            .and_then(|chat_body| parse_json::<ChatCompletionRequest>(Ok(chat_body), BODY_LIMIT))
            .and_then(|req| chat::prepare(&req, &ctx))
            .map(|(prompt, plan)| (vec![prompt], plan)),
    };
    let (prompts, plan) = match prepared {
        Ok(p) => p,
        Err(e) => return client_error(&e, body),
    };
    if prompts.is_empty() || prompts.len() * plan.n > MAX_QUEUE {
        return Err(format!("{} prompts x n = {}", prompts.len(), plan.n));
    }
    let too_long = |p: &&Vec<u32>| p.is_empty() || p.len() >= MAX_MODEL_LEN;
    if let Some(p) = prompts.iter().find(too_long) {
        return Err(format!("a prompt of {} ids", p.len()));
    }
    let t = &plan.template;
    let within = (1..=MAX_N as usize).contains(&plan.n)
        && t.max_tokens >= 1
        && t.sampling.validate().is_ok()
        && t.stop.len() <= MAX_STOP_STRINGS
        && t.stop_token_ids.len() <= MAX_STOP_TOKEN_IDS
        && t.logprobs.is_none_or(|k| k <= 20)
        && t.sampling.temperature <= MAX_API_TEMPERATURE
        && t.sampling.logit_bias.len() <= MAX_LOGIT_BIAS_ENTRIES
        && t.sampling
            .logit_bias
            .iter()
            .all(|&(id, bias)| (id as usize) < model_text().0.vocab_size() && bias.abs() as f64 <= MAX_LOGIT_BIAS)
        && (plan.max_tokens_field.is_none() || prompts.iter().all(|p| p.len() + t.max_tokens <= MAX_MODEL_LEN));
    if within {
        Ok(true)
    } else {
        Err(format!("accepted out of bounds: {plan:?}"))
    }
}

/// Mutated bodies of one endpoint's seeds, under the shared driver.
fn fuzz_endpoint(endpoint: Endpoint, name: &'static str) {
    let seeds: Arc<Vec<Value>> = Arc::new(
        seeds()
            .into_iter()
            .filter(|(e, _)| *e == endpoint)
            .map(|(_, v)| v)
            .collect(),
    );
    // Valid seeds pass (this also loads the tokenizer before any case counts its memory).
    for seed in seeds.iter() {
        assert_eq!(check(endpoint, seed.to_string().as_bytes()), Ok(true), "{seed}");
    }
    let bodies = (0..seeds.len(), prop::collection::vec(mutation(), 1..6))
        .prop_map(move |(i, mutations)| mutate(&seeds[i], &mutations));
    let target = Target {
        name,
        default_cases: 1000,
        bounds: REQUEST_BOUNDS,
    };
    fuzz(target, bodies, |body| match check(endpoint, body) {
        Ok(true) => Outcome::Accepted,
        Ok(false) => Outcome::Refused,
        Err(why) => panic!("{why}; add the body to regressions_stay_fixed"),
    });
}

#[test]
fn mutated_chat_bodies_get_a_4xx_or_a_request_within_the_limits() {
    fuzz_endpoint(Endpoint::Chat, "chat_request");
}

#[test]
fn mutated_completion_bodies_get_a_4xx_or_a_request_within_the_limits() {
    fuzz_endpoint(Endpoint::Completion, "completion_request");
}

#[test]
fn mutated_responses_bodies_get_a_4xx_or_a_request_within_the_limits() {
    fuzz_endpoint(Endpoint::Responses, "responses_request");
}

/// Bodies that once broke a parser or a limit.
#[test]
fn regressions_stay_fixed() {
    let cases: &[(Endpoint, &str)] = &[
        (
            Endpoint::Completion,
            r#"{"prompt": "x", "repetition_penalty": 18446744073709551616}"#,
        ),
        (Endpoint::Completion, r#"{"prompt": "x", "temperature": 1e400}"#),
        (
            Endpoint::Completion,
            r#"{"prompt": "x", "max_tokens": 18446744073709551616}"#,
        ),
        (
            Endpoint::Chat,
            r#"{"messages": [{"role": "user", "content": "\ud800"}]}"#,
        ),
        (Endpoint::Chat, r#"{"messages": null}"#),
        (Endpoint::Completion, r#"{"prompt": [[]]}"#),
        (Endpoint::Completion, r#"{"prompt": [], "n": 2}"#),
    ];
    for (endpoint, body) in cases {
        assert_eq!(check(*endpoint, body.as_bytes()), Ok(false), "{body}");
    }
    // More prompts than the queue holds: refused before any is tokenized.
    let many = json!({"prompt": vec!["hi"; MAX_QUEUE + 1]}).to_string();
    assert_eq!(check(Endpoint::Completion, many.as_bytes()), Ok(false));
}

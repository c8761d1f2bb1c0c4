//! Tool calls in model output: how each model family writes them (Hermes/Qwen2.5, Llama 3.x JSON,
//! Mistral), the streaming parser that splits output into content and calls, and the forcing grammar.

use std::ops::Range;

use serde_json::Value;
use strata_model::tokenizer::Tokenizer;

use crate::params::random_u64;

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen2.5 / Hermes: `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>` per call.
    Hermes,
    /// Llama 3.x: `{"name": .., "parameters": {..}}`, maybe after `<|python_tag|>`, `;` between calls.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]`.
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const LLAMA_OPEN: &str = "<|python_tag|>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";

impl ToolFormat {
    /// The format a chat template's text shows (its call markers); Hermes when it shows none.
    pub fn from_template(source: &str) -> ToolFormat {
        if source.contains(MISTRAL_OPEN) {
            ToolFormat::Mistral
        } else if source.contains(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if source.contains(LLAMA_OPEN) || source.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }

    /// The text that opens the calls.
    fn open_marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => HERMES_OPEN,
            ToolFormat::Llama3Json => LLAMA_OPEN,
            ToolFormat::Mistral => MISTRAL_OPEN,
        }
    }

    /// The key the family writes the arguments under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json => "parameters",
            ToolFormat::Hermes | ToolFormat::Mistral => "arguments",
        }
    }
}

/// A tool call read from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as the model wrote them.
    pub arguments: String,
}

/// A whole output split into its content and its calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Text outside the calls; `None` when there are calls and nothing else.
    pub content: Option<String>,
    pub calls: Vec<ParsedToolCall>,
}

/// What the streaming parser found in new output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside calls.
    Content(String),
    /// Call `index` begins (its arguments follow).
    CallStart { index: usize, id: String, name: String },
    /// More of call `index`'s arguments text.
    Arguments { index: usize, text: String },
}

/// A fresh call id: `call_` and 24 random letters and digits.
pub fn new_call_id() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = String::from("call_");
    let mut bits = random_u64();
    for i in 0..24 {
        if i % 10 == 0 {
            bits = random_u64();
        }
        id.push(ALPHABET[(bits % 62) as usize] as char);
        bits /= 62;
    }
    id
}

/// Splits model output into content and tool calls as it streams in.
///
/// Text that may be the start of a call (a partial marker, or a `{` opening the output) is held
/// back until it is decided. A call is announced once its name is read and its arguments have
/// begun (streaming), or once its object is complete (whole outputs), so an object that does not
/// parse stays content. Whitespace next to calls is dropped.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    format: ToolFormat,
    /// Declared function names: an unmarked (bare) JSON object is a call only when it names one.
    tools: Vec<String>,
    /// Calls after this many are dropped with the rest of the output (`parallel_tool_calls: false`).
    max_calls: usize,
    /// Announce a call before its object is complete.
    early: bool,
    /// Output not yet emitted or dropped.
    buf: String,
    mode: Mode,
    calls: usize,
    /// Non-whitespace content was emitted (a bare call may only open the output).
    seen_text: bool,
    /// Drop the whitespace that follows a call.
    trim_leading: bool,
    events: Vec<ToolEvent>,
}

#[derive(Debug, Clone)]
enum Mode {
    /// Plain text, watching for a call.
    Text,
    /// `buf[..marker]` opened a call (or a list of calls): whitespace, then `{` (or Mistral's `[`).
    Opening { marker: usize, list: bool, bare: bool },
    /// Inside a call's JSON object.
    Object(Box<ObjectScan>),
    /// After a call's object: the close marker, or the separator before another call.
    Closing { list: bool, bare: bool },
    /// All the calls allowed were made; the rest of the output is dropped.
    Done,
}

impl ToolCallParser {
    /// A parser for `format`'s calls of the functions named `tools`. `early`: announce calls as
    /// soon as their name is known (streaming).
    pub fn new(format: ToolFormat, tools: Vec<String>, parallel: bool, early: bool) -> Self {
        ToolCallParser {
            format,
            tools,
            max_calls: if parallel { usize::MAX } else { 1 },
            early,
            buf: String::new(),
            mode: Mode::Text,
            calls: 0,
            seen_text: false,
            trim_leading: false,
            events: Vec::new(),
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads more output; returns what it decided.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        while self.step() {}
        if self.early {
            self.announce_early();
        }
        std::mem::take(&mut self.events)
    }

    /// The output ended: whatever was held back is decided.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.mode, Mode::Done) {
            Mode::Text | Mode::Opening { .. } => self.content_at_end(rest),
            Mode::Object(scan) => match scan.committed {
                // What arrives after an announced call's arguments is not content.
                Some(_) => {}
                None => self.content_at_end(rest),
            },
            Mode::Closing { .. } | Mode::Done => {}
        }
        std::mem::take(&mut self.events)
    }

    /// Parses a whole output.
    pub fn parse(mut self, text: &str) -> ParsedOutput {
        let mut events = self.push(text);
        events.extend(self.finish());
        let mut content = String::new();
        let mut calls: Vec<ParsedToolCall> = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => content.push_str(&t),
                ToolEvent::CallStart { id, name, .. } => calls.push(ParsedToolCall {
                    id,
                    name,
                    arguments: String::new(),
                }),
                ToolEvent::Arguments { index, text } => {
                    if let Some(c) = calls.get_mut(index) {
                        c.arguments.push_str(&text);
                    }
                }
            }
        }
        let content = if calls.is_empty() || !content.trim().is_empty() {
            Some(content)
        } else {
            None
        };
        ParsedOutput { content, calls }
    }

    fn emit_content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if !text.trim().is_empty() {
            self.seen_text = true;
        }
        match self.events.last_mut() {
            Some(ToolEvent::Content(prev)) => prev.push_str(text),
            _ => self.events.push(ToolEvent::Content(text.to_string())),
        }
    }

    /// Held text at the end of the output: content, less the whitespace next to a call.
    fn content_at_end(&mut self, rest: String) {
        if self.calls == 0 {
            self.emit_content(&rest);
        } else {
            self.emit_content(rest.trim());
        }
    }

    /// Moves `buf[..end]` out of the buffer as content.
    fn flush_content(&mut self, end: usize) {
        let text: String = self.buf.drain(..end).collect();
        self.emit_content(&text);
    }

    /// One decision on the buffered text; false when more output is needed.
    fn step(&mut self) -> bool {
        match &self.mode {
            Mode::Text => self.step_text(),
            Mode::Opening { marker, list, bare } => {
                let (marker, list, bare) = (*marker, *list, *bare);
                self.step_opening(marker, list, bare)
            }
            Mode::Object(_) => self.step_object(),
            Mode::Closing { list, bare } => {
                let (list, bare) = (*list, *bare);
                self.step_closing(list, bare)
            }
            Mode::Done => {
                self.buf.clear();
                false
            }
        }
    }

    fn step_text(&mut self) -> bool {
        if self.trim_leading {
            let ws = self.buf.len() - self.buf.trim_start().len();
            self.buf.drain(..ws);
            if self.buf.is_empty() {
                return false;
            }
            self.trim_leading = false;
        }
        let marker = self.format.open_marker();
        // An output that opens with a JSON object (or Mistral's list) may be a call whose marker
        // was a special token and left no text.
        if !self.seen_text && self.calls == 0 {
            let body = self.buf.trim_start();
            if marker.starts_with(body) && body.len() < marker.len() {
                return false;
            }
            match body.as_bytes().first() {
                _ if body.starts_with(marker) => {}
                None => return false,
                Some(b'{') => {
                    self.mode = Mode::Opening {
                        marker: 0,
                        list: false,
                        bare: true,
                    };
                    return true;
                }
                Some(b'[') if self.format == ToolFormat::Mistral => {
                    self.mode = Mode::Opening {
                        marker: 0,
                        list: false,
                        bare: true,
                    };
                    return true;
                }
                Some(_) => {}
            }
        }
        if let Some(at) = self.buf.find(marker) {
            // The whitespace before the marker goes with it: dropped with a call, kept without.
            let before = self.buf[..at].trim_end().len();
            self.flush_content(before);
            self.mode = Mode::Opening {
                marker: at - before + marker.len(),
                list: false,
                bare: false,
            };
            return true;
        }
        // Hold a possible marker's start, and trailing whitespace (it may precede a call).
        let held = partial_suffix(&self.buf, marker);
        let end = self.buf[..self.buf.len() - held].trim_end().len();
        if end == 0 {
            return false;
        }
        self.flush_content(end);
        true
    }

    fn step_opening(&mut self, marker: usize, list: bool, bare: bool) -> bool {
        let rest = &self.buf[marker..];
        let body = rest.trim_start();
        let at = self.buf.len() - body.len();
        match body.as_bytes().first() {
            None => false,
            Some(b'{') => {
                self.mode = Mode::Object(Box::new(ObjectScan::new(at, list, bare)));
                true
            }
            Some(b'[') if self.format == ToolFormat::Mistral && !list => {
                self.mode = Mode::Opening {
                    marker: at + 1,
                    list: true,
                    bare,
                };
                true
            }
            Some(_) => {
                // Not a call after all: the marker is text.
                self.flush_content(marker.max(at));
                self.seen_text = true;
                self.mode = Mode::Text;
                true
            }
        }
    }

    fn step_object(&mut self) -> bool {
        let Mode::Object(scan) = &mut self.mode else {
            return false;
        };
        scan.scan(&self.buf);
        let Some(end) = scan.end else {
            return false;
        };
        let scan = match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Object(scan) => scan,
            _ => return false,
        };
        let (list, bare) = (scan.list, scan.bare);
        match scan.committed {
            Some(committed) => {
                if let Some((_, to)) = scan.arguments(&self.buf) {
                    self.emit_arguments(committed.index, committed.sent, to);
                }
                self.buf.drain(..end);
                self.after_call(list, bare);
            }
            None => match self.complete_call(&scan) {
                Some((name, text)) => {
                    let index = self.announce(name);
                    self.events.push(ToolEvent::Arguments { index, text });
                    self.buf.drain(..end);
                    self.after_call(list, bare);
                }
                None => {
                    // Not a call: the marker and the object are text.
                    self.flush_content(end);
                    self.seen_text = true;
                }
            },
        }
        true
    }

    fn after_call(&mut self, list: bool, bare: bool) {
        self.mode = if self.calls >= self.max_calls {
            Mode::Done
        } else {
            Mode::Closing { list, bare }
        };
    }

    fn step_closing(&mut self, list: bool, bare: bool) -> bool {
        let body = self.buf.trim_start();
        let skipped = self.buf.len() - body.len();
        let Some(&first) = body.as_bytes().first() else {
            return false;
        };
        let next_opening = |marker| Mode::Opening { marker, list, bare };
        let (consumed, mode) = match self.format {
            _ if list && first == b',' => (skipped + 1, next_opening(0)),
            _ if list && first == b']' => (skipped + 1, Mode::Text),
            ToolFormat::Llama3Json if first == b';' => (skipped + 1, next_opening(0)),
            ToolFormat::Hermes if !bare => {
                if body.starts_with(HERMES_CLOSE) {
                    (skipped + HERMES_CLOSE.len(), Mode::Text)
                } else if HERMES_CLOSE.starts_with(body) {
                    return false;
                } else {
                    // A call missing its close marker: what follows is text.
                    (skipped, Mode::Text)
                }
            }
            _ => (skipped, Mode::Text),
        };
        self.buf.drain(..consumed);
        self.trim_leading = matches!(mode, Mode::Text);
        self.mode = mode;
        true
    }

    /// Numbers a new call and emits its start.
    fn announce(&mut self, name: String) -> usize {
        let index = self.calls;
        self.calls += 1;
        self.events.push(ToolEvent::CallStart {
            index,
            id: new_call_id(),
            name,
        });
        index
    }

    /// Emits `buf[from..to]` as arguments of call `index`.
    fn emit_arguments(&mut self, index: usize, from: usize, to: usize) {
        if to > from {
            if let Some(text) = self.buf.get(from..to) {
                let text = text.to_string();
                self.events.push(ToolEvent::Arguments { index, text });
            }
        }
    }

    /// Streaming: announces a call whose name is read and whose arguments object has begun, and
    /// sends the arguments text that came since.
    fn announce_early(&mut self) {
        let Mode::Object(scan) = &self.mode else {
            return;
        };
        let Some((from, to)) = scan.arguments(&self.buf) else {
            return;
        };
        let (index, from) = match scan.committed {
            Some(c) => (c.index, c.sent),
            None => {
                let bare = scan.bare;
                let Some(name) = scan.name(&self.buf).filter(|n| !bare || self.tools.contains(n)) else {
                    return;
                };
                (self.announce(name), from)
            }
        };
        self.emit_arguments(index, from, to);
        if let Mode::Object(scan) = &mut self.mode {
            scan.committed = Some(Committed {
                index,
                sent: to.max(from),
            });
        }
    }

    /// The name and arguments text of a complete call object, or `None` when it is not one.
    fn complete_call(&self, scan: &ObjectScan) -> Option<(String, String)> {
        let object: Value = serde_json::from_str(self.buf.get(scan.start..scan.end?)?).ok()?;
        let object = object.as_object()?;
        let name = object.get("name")?.as_str()?.to_string();
        if name.is_empty() || (scan.bare && !self.tools.contains(&name)) {
            return None;
        }
        match ARGUMENT_KEYS.iter().find_map(|k| object.get(*k)) {
            // A function without parameters may be called without arguments.
            None => Some((name, "{}".into())),
            // The text as written, as a stream sends it.
            Some(Value::Object(_)) => {
                let (from, to) = scan.arguments(&self.buf)?;
                Some((name, self.buf.get(from..to)?.to_string()))
            }
            // Arguments that are not an object (a string holding one is not unwrapped while
            // streaming, so not here either) make it no call.
            Some(_) => None,
        }
    }
}

/// The keys a call object may hold its arguments under.
const ARGUMENT_KEYS: [&str; 2] = ["arguments", "parameters"];

/// A call announced before its object ended.
#[derive(Debug, Clone, Copy)]
struct Committed {
    index: usize,
    /// Arguments text up to here was sent.
    sent: usize,
}

/// Reads a call's JSON object as it arrives, recording where its top-level `name` and
/// `arguments`/`parameters` values lie in the buffer.
#[derive(Debug, Clone)]
struct ObjectScan {
    /// Where the object's `{` is.
    start: usize,
    /// Next byte to read.
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// At depth 1, the next string is a key.
    expect_key: bool,
    key_start: usize,
    /// The last key read at depth 1.
    key: Option<String>,
    /// The key of the depth-1 value being read and where that value starts.
    value: Option<(String, usize)>,
    /// End of the significant text of that value so far (trailing whitespace excluded).
    value_end: usize,
    fields: Vec<(String, Range<usize>)>,
    /// One past the closing `}`.
    end: Option<usize>,
    committed: Option<Committed>,
    /// Inside Mistral's `[...]` list.
    list: bool,
    /// No marker opened it.
    bare: bool,
}

impl ObjectScan {
    fn new(start: usize, list: bool, bare: bool) -> Self {
        ObjectScan {
            start,
            pos: start,
            depth: 0,
            in_string: false,
            escaped: false,
            expect_key: false,
            key_start: start,
            key: None,
            value: None,
            value_end: start,
            fields: Vec::new(),
            end: None,
            committed: None,
            list,
            bare,
        }
    }

    fn scan(&mut self, buf: &str) {
        let bytes = buf.as_bytes();
        while self.end.is_none() && self.pos < bytes.len() {
            let i = self.pos;
            let b = bytes[i];
            self.pos += 1;
            let in_value = self.depth >= 2 || (self.depth == 1 && !self.expect_key);
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.depth == 1 && self.expect_key {
                        self.key = buf
                            .get(self.key_start..i + 1)
                            .and_then(|k| serde_json::from_str(k).ok());
                    }
                }
                if in_value {
                    self.value_end = i + 1;
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 && self.expect_key {
                        self.key_start = i;
                    } else {
                        self.begin_value(i);
                    }
                }
                b'{' | b'[' => {
                    if self.depth == 0 {
                        self.expect_key = true;
                    } else {
                        self.begin_value(i);
                    }
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.finish_value();
                        self.end = Some(i + 1);
                    }
                }
                b':' if self.depth == 1 => {
                    self.expect_key = false;
                    self.value = self.key.take().map(|k| (k, usize::MAX));
                }
                b',' if self.depth == 1 => {
                    self.finish_value();
                    self.expect_key = true;
                }
                b' ' | b'\t' | b'\n' | b'\r' => continue,
                _ => self.begin_value(i),
            }
            if self.depth >= 2 || (self.depth == 1 && !self.expect_key && b != b':') {
                self.value_end = i + 1;
            }
        }
    }

    /// A depth-1 value starts at `i` (no-op for a value already started or nested text).
    fn begin_value(&mut self, i: usize) {
        if self.depth != 1 {
            return;
        }
        if let Some((_, start)) = &mut self.value {
            if *start == usize::MAX {
                *start = i;
            }
        }
    }

    fn finish_value(&mut self) {
        if let Some((key, start)) = self.value.take() {
            if start != usize::MAX {
                self.fields.push((key, start..self.value_end));
            }
        }
    }

    fn field(&self, key: &str) -> Option<Range<usize>> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, r)| r.clone())
    }

    /// The complete `name` value, when it is a non-empty string.
    fn name(&self, buf: &str) -> Option<String> {
        let range = self.field("name")?;
        let name: String = serde_json::from_str(buf.get(range)?).ok()?;
        (!name.is_empty()).then_some(name)
    }

    /// Where the arguments object starts and where its text read so far ends, once it has begun.
    fn arguments(&self, buf: &str) -> Option<(usize, usize)> {
        let (start, end) = match &self.value {
            Some((key, start)) if ARGUMENT_KEYS.contains(&key.as_str()) && *start != usize::MAX => {
                (*start, self.value_end)
            }
            _ => {
                let r = ARGUMENT_KEYS.iter().find_map(|k| self.field(k))?;
                (r.start, r.end)
            }
        };
        (buf.as_bytes().get(start) == Some(&b'{')).then_some((start, end))
    }
}

/// Length of the longest proper suffix of `text` that begins `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// One function a grammar may call: its name and the JSON schema of its arguments.
#[derive(Debug, Clone, Copy)]
pub struct CallableFunction<'a> {
    pub name: &'a str,
    pub parameters: Option<&'a Value>,
}

/// A Lark grammar (llguidance's dialect) for output that is only tool calls in `format`, each to
/// one of `functions` with arguments that match its schema; one call unless `parallel`.
/// Markers that are special tokens of the vocabulary are matched as those tokens.
pub fn call_grammar(
    format: ToolFormat,
    functions: &[CallableFunction],
    parallel: bool,
    tokenizer: &Tokenizer,
) -> String {
    let body = (0..functions.len())
        .map(|i| format!("fn_{i}"))
        .collect::<Vec<_>>()
        .join(" | ");
    let (call, separator) = match format {
        ToolFormat::Hermes => (
            format!(
                "{} \"\\n\" body \"\\n\" {}",
                lark_marker(HERMES_OPEN, tokenizer),
                lark_marker(HERMES_CLOSE, tokenizer)
            ),
            "\"\\n\"",
        ),
        ToolFormat::Llama3Json => ("body".to_string(), "\"; \""),
        ToolFormat::Mistral => ("body".to_string(), "\", \""),
    };
    let calls = if parallel {
        format!("call ({separator} call)*")
    } else {
        "call".to_string()
    };
    let start = match format {
        ToolFormat::Mistral => format!("{} \" [\" {calls} \"]\"", lark_marker(MISTRAL_OPEN, tokenizer)),
        ToolFormat::Hermes | ToolFormat::Llama3Json => calls,
    };
    let mut grammar = format!("start: {start}\ncall: {call}\nbody: {body}\n");
    for (i, f) in functions.iter().enumerate() {
        let schema = call_schema(format, f);
        grammar.push_str(&format!("fn_{i}: %json {schema}\n"));
    }
    grammar
}

/// The JSON schema of one call object: the function's name, then its arguments, compact JSON with
/// the `", "` and `": "` separators models are trained on.
fn call_schema(format: ToolFormat, f: &CallableFunction) -> Value {
    let no_arguments = serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false});
    let arguments = f.parameters.cloned().unwrap_or(no_arguments);
    let key = format.arguments_key();
    serde_json::json!({
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true},
        "type": "object",
        "properties": {"name": {"const": f.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": false,
    })
}

/// A marker in a Lark grammar: the special token when the vocabulary has it as one, else text.
fn lark_marker(marker: &str, tokenizer: &Tokenizer) -> String {
    match tokenizer.token_to_id(marker) {
        Some(id) if tokenizer.is_special(id) => format!("<[{id}]>"),
        _ => Value::from(marker).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, OnceLock};

    use strata_engine::{GrammarCompiler, OutputConstraint};
    use strata_model::loader::{default_model_path, load_text};

    use super::*;

    fn tools() -> Vec<String> {
        vec!["get_weather".into(), "get_time".into()]
    }

    fn parse(format: ToolFormat, text: &str) -> ParsedOutput {
        ToolCallParser::new(format, tools(), true, false).parse(text)
    }

    /// (name, arguments) of each call.
    fn calls(out: &ParsedOutput) -> Vec<(&str, &str)> {
        out.calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect()
    }

    /// Streams `pieces` through a parser and puts the events back together.
    fn stream(format: ToolFormat, parallel: bool, pieces: &[&str]) -> (ParsedOutput, Vec<ToolEvent>) {
        let mut parser = ToolCallParser::new(format, tools(), parallel, true);
        let mut events = Vec::new();
        for p in pieces {
            events.extend(parser.push(p));
        }
        events.extend(parser.finish());
        let mut content = String::new();
        let mut calls: Vec<ParsedToolCall> = Vec::new();
        for e in &events {
            match e.clone() {
                ToolEvent::Content(t) => content.push_str(&t),
                ToolEvent::CallStart { index, id, name } => {
                    assert_eq!(index, calls.len(), "calls are numbered in order");
                    calls.push(ParsedToolCall {
                        id,
                        name,
                        arguments: String::new(),
                    })
                }
                ToolEvent::Arguments { index, text } => calls[index].arguments.push_str(&text),
            }
        }
        let content = (calls.is_empty() || !content.is_empty()).then_some(content);
        (ParsedOutput { content, calls }, events)
    }

    fn chars(text: &str) -> Vec<String> {
        text.chars().map(String::from).collect()
    }

    #[test]
    fn the_template_text_picks_the_format() {
        assert_eq!(
            ToolFormat::from_template("{{ '<tool_call>' }}{% for t in tools %}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::from_template("{{ '[TOOL_CALLS] ' }}{{ tools }}"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::from_template("{{ '<|python_tag|>' }}{{ tools }}"),
            ToolFormat::Llama3Json
        );
        assert_eq!(
            ToolFormat::from_template("<|start_header_id|>ipython<|end_header_id|>"),
            ToolFormat::Llama3Json
        );
        assert_eq!(ToolFormat::from_template("{{ messages }}"), ToolFormat::Hermes);
    }

    #[test]
    fn hermes_calls_are_read_with_the_text_around_them() {
        let out = parse(
            ToolFormat::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(out.content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls(&out),
            vec![("get_weather", "{\"city\": \"Paris\"}"), ("get_time", "{}")]
        );
        assert!(out.calls.iter().all(|c| c.id.starts_with("call_") && c.id.len() == 29));
        assert_ne!(out.calls[0].id, out.calls[1].id);
        // Only calls: no content.
        let only = parse(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>",
        );
        assert_eq!(only.content, None);
        assert_eq!(calls(&only), vec![("get_time", "{\"tz\": \"UTC\"}")]);
    }

    #[test]
    fn llama_calls_are_read_bare_or_after_the_python_tag() {
        let bare = parse(
            ToolFormat::Llama3Json,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"days\": [1, 2]}}",
        );
        assert_eq!(bare.content, None);
        assert_eq!(
            calls(&bare),
            vec![("get_weather", "{\"city\": \"Oslo\", \"days\": [1, 2]}")]
        );
        let tagged = parse(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
        );
        assert_eq!(tagged.content, None);
        assert_eq!(
            calls(&tagged),
            vec![("get_time", "{}"), ("get_weather", "{\"city\": \"Rome\"}")]
        );
    }

    #[test]
    fn mistral_calls_are_read_from_the_list() {
        let out = parse(
            ToolFormat::Mistral,
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}, {\"name\": \"get_time\", \"arguments\": {}}]",
        );
        assert_eq!(out.content, None);
        assert_eq!(
            calls(&out),
            vec![("get_weather", "{\"city\": \"Lima\"}"), ("get_time", "{}")]
        );
        // `[TOOL_CALLS]` is a special token, which decoding drops: the bare list is read too.
        let bare = parse(
            ToolFormat::Mistral,
            "[{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}]",
        );
        assert_eq!(calls(&bare), vec![("get_time", "{\"tz\": \"CET\"}")]);
    }

    #[test]
    fn what_is_not_a_call_stays_content_exactly() {
        // Broken JSON inside the markers (streamed, the call is announced before the break shows).
        let broken = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": }}\n</tool_call>";
        assert_eq!(parse(ToolFormat::Hermes, broken).content.as_deref(), Some(broken));
        for (format, text) in [
            // Cut off mid-call.
            (ToolFormat::Hermes, "Sure <tool_call>\n{\"name\": \"get_time\", \"argu"),
            // No name.
            (ToolFormat::Hermes, "<tool_call>{\"arguments\": {}}</tool_call>"),
            // Arguments that are not an object.
            (
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"get_time\", \"arguments\": 3}</tool_call>",
            ),
            // A JSON answer naming no declared tool.
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"Bob\", \"parameters\": {\"age\": 3}}",
            ),
            (ToolFormat::Hermes, "  {\"answer\": 42}\n"),
            (ToolFormat::Mistral, "[1, 2, 3]"),
            // Marker look-alikes and trailing whitespace.
            (ToolFormat::Hermes, "a < b and <tool_ but not a call  \n"),
            (ToolFormat::Mistral, "[TOOL_CALLS] nothing"),
            (ToolFormat::Hermes, "   "),
            (ToolFormat::Hermes, ""),
        ] {
            let whole = parse(format, text);
            assert!(whole.calls.is_empty(), "{text:?}: {whole:?}");
            assert_eq!(whole.content.as_deref(), Some(text), "{format:?}");
            let (streamed, _) = stream(
                format,
                true,
                &chars(text).iter().map(String::as_str).collect::<Vec<_>>(),
            );
            assert!(streamed.calls.is_empty(), "{text:?}: {streamed:?}");
            assert_eq!(streamed.content.as_deref(), Some(text), "{format:?} streamed");
        }
    }

    #[test]
    fn a_call_split_into_single_characters_streams_as_one_call() {
        let text = "I will look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"São Paulo\", \"units\": [\"C\"]}}\n</tool_call>";
        let pieces = chars(text);
        let (streamed, events) = stream(
            ToolFormat::Hermes,
            true,
            &pieces.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let whole = parse(ToolFormat::Hermes, text);
        assert_eq!(streamed.content, whole.content);
        assert_eq!(calls(&streamed), calls(&whole));
        assert_eq!(
            calls(&streamed),
            vec![("get_weather", "{\"city\": \"São Paulo\", \"units\": [\"C\"]}")]
        );
        // Content first, never a piece of the marker; then the call's start; then its
        // arguments in many pieces as they came.
        let first_call = events
            .iter()
            .position(|e| matches!(e, ToolEvent::CallStart { .. }))
            .unwrap();
        assert!(events[..first_call]
            .iter()
            .all(|e| matches!(e, ToolEvent::Content(t) if !t.contains('<'))));
        let arguments = events[first_call + 1..]
            .iter()
            .filter(|e| matches!(e, ToolEvent::Arguments { index: 0, .. }))
            .count();
        assert!(arguments > 10, "{events:?}");
        assert!(events[first_call + 1..]
            .iter()
            .all(|e| matches!(e, ToolEvent::Arguments { .. })));
    }

    #[test]
    fn a_call_is_announced_before_its_object_ends() {
        let mut parser = ToolCallParser::new(ToolFormat::Hermes, tools(), true, true);
        assert_eq!(parser.push("Hi <tool"), vec![ToolEvent::Content("Hi".into())]);
        assert_eq!(parser.push("_call>\n{\"name\": \"get_ti"), vec![]);
        let events = parser.push("me\", \"arguments\": {\"tz\": \"U");
        match &events[..] {
            [ToolEvent::CallStart { index: 0, name, .. }, ToolEvent::Arguments { index: 0, text }] => {
                assert_eq!(name, "get_time");
                assert_eq!(text, "{\"tz\": \"U");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            parser.push("TC\"}}\n</tool_call>"),
            vec![ToolEvent::Arguments {
                index: 0,
                text: "TC\"}".into()
            }]
        );
        assert_eq!(parser.finish(), vec![]);
        assert_eq!(parser.calls(), 1);
    }

    #[test]
    fn two_parallel_calls_stream_with_their_indexes() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";
        // Pieces of 3 bytes or so (on character boundaries).
        let cs = chars(text);
        let pieces: Vec<String> = cs.chunks(3).map(|c| c.concat()).collect();
        let (streamed, events) = stream(
            ToolFormat::Hermes,
            true,
            &pieces.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        assert_eq!(streamed.content, None);
        assert_eq!(
            calls(&streamed),
            vec![
                ("get_weather", "{\"city\": \"Bern\"}"),
                ("get_time", "{\"tz\": \"CET\"}")
            ]
        );
        let starts: Vec<usize> = events
            .iter()
            .filter_map(|e| match e {
                ToolEvent::CallStart { index, .. } => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(starts, vec![0, 1]);
        // Whitespace between the calls is not content.
        assert!(!events.iter().any(|e| matches!(e, ToolEvent::Content(_))));
    }

    #[test]
    fn without_parallel_calls_only_the_first_is_kept() {
        let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
        let (streamed, _) = stream(ToolFormat::Hermes, false, &[text]);
        assert_eq!(calls(&streamed), vec![("get_time", "{}")]);
        let whole = ToolCallParser::new(ToolFormat::Hermes, tools(), false, false).parse(text);
        assert_eq!(calls(&whole), vec![("get_time", "{}")]);
    }

    /// The default model's tokenizer and a grammar compiler over its vocabulary.
    fn compiler() -> &'static (Arc<Tokenizer>, GrammarCompiler) {
        static COMPILER: OnceLock<(Arc<Tokenizer>, GrammarCompiler)> = OnceLock::new();
        COMPILER.get_or_init(|| {
            let (tokenizer, _) = load_text(&default_model_path()).expect("default model (run `make fetch`)");
            let tokenizer = Arc::new(tokenizer);
            let compiler = GrammarCompiler::new(Arc::clone(&tokenizer)).expect("grammar compiler");
            (tokenizer, compiler)
        })
    }

    /// Whether the grammar accepts `text` as a whole output.
    fn accepts(grammar: &str, text: &str) -> bool {
        let (tokenizer, compiler) = compiler();
        let mut matcher = compiler
            .matcher(&OutputConstraint::Lark(grammar.to_string()))
            .unwrap_or_else(|e| panic!("grammar does not compile: {e}\n{grammar}"));
        let tokens = tokenizer.encode(text, false, false).expect("tokenizes");
        let valid = matcher.validate_tokens(&tokens).expect("validates");
        if valid < tokens.len() {
            return false;
        }
        matcher.consume_tokens(&tokens).expect("consumes");
        matcher.is_accepting().expect("accepting")
    }

    fn weather_schema() -> Value {
        serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]})
    }

    #[test]
    fn forced_call_grammars_accept_only_calls_matching_the_schema() {
        let (tokenizer, _) = compiler();
        let schema = weather_schema();
        let functions = [
            CallableFunction {
                name: "get_weather",
                parameters: Some(&schema),
            },
            CallableFunction {
                name: "get_time",
                parameters: None,
            },
        ];
        let one = call_grammar(ToolFormat::Hermes, &functions, false, tokenizer);
        let many = call_grammar(ToolFormat::Hermes, &functions, true, tokenizer);
        let weather =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
        let time = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        assert!(accepts(&one, weather));
        assert!(accepts(&one, time));
        assert!(!accepts(&one, &format!("{weather}\n{time}")), "one call only");
        assert!(accepts(&many, &format!("{weather}\n{time}")));
        for bad in [
            // Arguments breaking the schema: a missing required key, a wrong type, an unknown function.
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 2}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 7}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"x\": 1}\n</tool_call>",
            "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>",
            "Sure! <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}",
        ] {
            assert!(!accepts(&many, bad), "accepted {bad}");
        }
        // What the grammar makes is what the parser reads.
        let out = parse(ToolFormat::Hermes, &format!("{weather}\n{time}"));
        assert_eq!(
            calls(&out),
            vec![
                ("get_weather", "{\"city\": \"Paris\", \"days\": 2}"),
                ("get_time", "{}")
            ]
        );
    }

    #[test]
    fn llama_and_mistral_grammars_write_their_own_syntax() {
        let (tokenizer, _) = compiler();
        let schema = weather_schema();
        let functions = [CallableFunction {
            name: "get_weather",
            parameters: Some(&schema),
        }];
        let llama = call_grammar(ToolFormat::Llama3Json, &functions, true, tokenizer);
        assert!(accepts(
            &llama,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}"
        ));
        assert!(!accepts(
            &llama,
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"
        ));
        let mistral = call_grammar(ToolFormat::Mistral, &functions, true, tokenizer);
        assert!(accepts(
            &mistral,
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]"
        ));
        assert!(!accepts(
            &mistral,
            "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]"
        ));
    }

    #[test]
    fn markers_that_are_special_tokens_are_matched_as_tokens() {
        let (tokenizer, compiler) = compiler();
        let id = tokenizer.token_to_id("<|im_start|>").expect("ChatML vocabulary");
        assert!(tokenizer.is_special(id));
        assert_eq!(lark_marker("<|im_start|>", tokenizer), format!("<[{id}]>"));
        assert_eq!(lark_marker("<tool_call>", tokenizer), "\"<tool_call>\"");
        let grammar = format!("start: {} \"x\"", lark_marker("<|im_start|>", tokenizer));
        let accepts_ids = |ids: &[u32]| {
            let mut m = compiler
                .matcher(&OutputConstraint::Lark(grammar.clone()))
                .expect("compiles");
            m.validate_tokens(ids).expect("validates") == ids.len() && {
                m.consume_tokens(ids).expect("consumes");
                m.is_accepting().expect("accepting")
            }
        };
        let special = tokenizer.encode("<|im_start|>x", false, true).unwrap();
        assert_eq!(special[0], id);
        assert!(accepts_ids(&special));
        // The same characters as text are not the token.
        assert!(!accepts_ids(&tokenizer.encode("<|im_start|>x", false, false).unwrap()));
    }

    /// Pieces that make calls, near-calls and text.
    const FRAGMENTS: [&str; 16] = [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        " ",
        "\n",
        "\"name\"",
        "\"get_time\"",
        "\"arguments\"",
        "é",
        "[TOOL_CALLS]",
    ];

    proptest::proptest! {
        #[test]
        fn any_output_streams_without_loss(
            picks in proptest::collection::vec(0..FRAGMENTS.len(), 0..40),
            cuts in proptest::collection::vec(0usize..64, 0..8),
            format in proptest::sample::select(vec![ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Mistral]),
        ) {
            let text: String = picks.iter().map(|&i| FRAGMENTS[i]).collect();
            // Cut the text at arbitrary character boundaries.
            let cs = chars(&text);
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (cs.len() + 1)).collect();
            at.push(cs.len());
            at.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for to in at {
                pieces.push(cs[from..to].concat());
                from = to;
            }
            let whole = parse(format, &text);
            let (streamed, _) = stream(format, true, &pieces.iter().map(String::as_str).collect::<Vec<_>>());
            // Text with no calls in it comes back exactly, whole or streamed.
            if whole.calls.is_empty() {
                proptest::prop_assert_eq!(whole.content.as_deref(), Some(text.as_str()));
            }
            if streamed.calls.is_empty() {
                proptest::prop_assert_eq!(streamed.content.as_deref(), Some(text.as_str()));
            }
            // A streamed call is a whole output's call too, unless its JSON broke after it began.
            for c in &whole.calls {
                proptest::prop_assert!(streamed.calls.iter().any(|s| s.name == c.name && s.arguments == c.arguments));
            }
        }
    }

    #[test]
    fn call_ids_look_like_openais() {
        let id = new_call_id();
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        assert!(id[5..].bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(new_call_id(), new_call_id());
    }
}

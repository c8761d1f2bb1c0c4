//! Chat templates: renders a conversation into a model's prompt with the Jinja template shipped in
//! GGUF (`tokenizer.chat_template`) or `tokenizer_config.json`, matching what HF transformers renders.
//!
//! The environment mirrors transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks`
//! on, `bos_token`/`eos_token` variables, `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson`
//! filter that writes JSON the way Python's `json.dumps` does, and Python string/dict methods
//! (`.strip()`, `.startswith()`, `.items()`, ...) from minijinja-contrib's pycompat.
//!
//! Fallback: a model without a template gets [`CHATML_TEMPLATE`] and a logged warning, because
//! ChatML is what most instruction-tuned small models (SmolLM, Qwen, ...) were trained on.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use strata_formats::gguf::GgufFile;
use strata_formats::limits::{read_text_limited, MAX_JSON_FILE_BYTES};

/// The template used when a model ships none: plain ChatML.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template itself called `raise_exception(message)` (e.g. "roles must alternate").
    #[error("{0}")]
    Raised(String),
    #[error("the chat template does not compile: {0}")]
    Syntax(String),
    #[error("rendering the chat template failed: {0}")]
    Render(String),
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {message}")]
    BadConfig { path: PathBuf, message: String },
    #[error("no chat template named `{name}` (available: {available})")]
    NoSuchTemplate { name: String, available: String },
}

/// A compiled chat template plus the special-token strings it may refer to.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    is_fallback: bool,
    /// The template reads the `tools` variable.
    reads_tools: bool,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("is_fallback", &self.is_fallback)
            .field("reads_tools", &self.reads_tools)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`, with the strings templates see as `bos_token` and `eos_token`.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        let reads_tools = env
            .get_template(TEMPLATE_NAME)
            .map(|t| t.undeclared_variables(false).contains("tools"))
            .unwrap_or(false);
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            is_fallback: false,
            reads_tools,
        })
    }

    /// The ChatML fallback (see the module docs).
    pub fn chatml(bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        match Self::new(CHATML_TEMPLATE, bos_token, eos_token) {
            Ok(mut t) => {
                t.is_fallback = true;
                t
            }
            // The constant template always compiles; this arm only keeps the signature infallible.
            Err(e) => unreachable!("built-in ChatML template: {e}"),
        }
    }

    /// The template in a GGUF file's `tokenizer.chat_template`, with BOS/EOS strings from its
    /// vocabulary; ChatML (with a warning) when the file has none.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TemplateError> {
        let token = |key: &str| -> String {
            gguf.get_u64(key)
                .and_then(|id| {
                    gguf.get_array("tokenizer.ggml.tokens")?
                        .get(usize::try_from(id).ok()?)?
                        .as_str()
                })
                .unwrap_or_default()
                .to_string()
        };
        let (bos, eos) = (
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        );
        match gguf.get_str("tokenizer.chat_template") {
            Some(source) => Self::new(source, bos, eos),
            None => {
                tracing::warn!("model has no tokenizer.chat_template; falling back to ChatML, which may not be the format it was trained on");
                Ok(Self::chatml(bos, eos))
            }
        }
    }

    /// The default template of a `tokenizer_config.json` (`chat_template` as a string, or the
    /// entry named `default` of a list of named templates).
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, TemplateError> {
        Self::from_tokenizer_config_named(path, None)
    }

    /// Like [`Self::from_tokenizer_config`], choosing a named template (e.g. `tool_use`).
    pub fn from_tokenizer_config_named(path: impl AsRef<Path>, name: Option<&str>) -> Result<Self, TemplateError> {
        let path = path.as_ref();
        let text = read_text_limited(path, MAX_JSON_FILE_BYTES).map_err(|error| TemplateError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| TemplateError::BadConfig {
            path: path.to_path_buf(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_tokenizer_config_value(&config, name).map_err(|e| match e {
            TemplateError::BadConfig { message, .. } => TemplateError::BadConfig {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Like [`Self::from_tokenizer_config_named`] for an already parsed config.
    pub fn from_tokenizer_config_value(config: &serde_json::Value, name: Option<&str>) -> Result<Self, TemplateError> {
        let token = |key: &str| {
            config
                .get(key)
                .and_then(crate::tokenizer::config_token_text)
                .unwrap_or_default()
        };
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        let bad = |message: String| TemplateError::BadConfig {
            path: PathBuf::new(),
            message,
        };
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => {
                tracing::warn!("tokenizer_config.json has no chat_template; falling back to ChatML, which may not be the format the model was trained on");
                Ok(Self::chatml(bos, eos))
            }
            Some(serde_json::Value::String(source)) => match name {
                None | Some("default") => Self::new(source.as_str(), bos, eos),
                Some(other) => Err(TemplateError::NoSuchTemplate {
                    name: other.into(),
                    available: "default".into(),
                }),
            },
            Some(serde_json::Value::Array(items)) => {
                let mut named = Vec::new();
                for item in items {
                    let n = item.get("name").and_then(|v| v.as_str());
                    let t = item.get("template").and_then(|v| v.as_str());
                    match (n, t) {
                        (Some(n), Some(t)) => named.push((n, t)),
                        _ => {
                            return Err(bad(
                                "chat_template list entries need string `name` and `template`".into()
                            ))
                        }
                    }
                }
                let wanted = name.unwrap_or("default");
                let found = named.iter().find(|(n, _)| *n == wanted);
                match (found, name) {
                    (Some((_, t)), _) => Self::new(*t, bos, eos),
                    (None, None) if !named.is_empty() => {
                        tracing::warn!(
                            "tokenizer_config.json has no template named `default`; using `{}`",
                            named[0].0
                        );
                        Self::new(named[0].1, bos, eos)
                    }
                    _ => Err(TemplateError::NoSuchTemplate {
                        name: wanted.into(),
                        available: named.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
                    }),
                }
            }
            Some(other) => Err(bad(format!("chat_template must be a string or a list, found {other}"))),
        }
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether this is the ChatML fallback rather than the model's own template.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// Whether the template renders tool definitions itself (it reads the `tools` variable).
    pub fn renders_tools(&self) -> bool {
        self.reads_tools
    }

    /// Whether the template renders assistant `tool_calls` (and so `tool` messages) itself.
    pub fn renders_tool_calls(&self) -> bool {
        self.source.contains("tool_calls")
    }

    /// The string templates see as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The string templates see as `eos_token`.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages`; `add_generation_prompt` appends the opening of an assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders any serializable message list (e.g. messages with `tool_calls` or content parts),
    /// with `extra` variables such as `tools` or `documents` added to the template context.
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TemplateError> {
        // transformers always passes `tools` and `documents` (None unless given).
        let mut ctx: BTreeMap<String, Value> = [
            ("tools".to_string(), Value::from(())),
            ("documents".to_string(), Value::from(())),
        ]
        .into_iter()
        .collect();
        ctx.extend(extra.iter().map(|(k, v)| (k.clone(), Value::from_serialize(v))));
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        template.render(Value::from(ctx)).map_err(|e| match raised_message(&e) {
            Some(message) => TemplateError::Raised(message),
            None => TemplateError::Render(describe(&e)),
        })
    }
}

/// The error `raise_exception` attaches, so `render` can tell it from template bugs.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

fn raised_message(e: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(r) = err.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        source = err.source();
    }
    None
}

/// An error with its template location, on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let (Some(name), Some(line)) = (e.name(), e.line()) {
        if !s.contains(&format!("line {line}")) {
            let _ = write!(s, " ({name} line {line})");
        }
    }
    s
}

fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default();
    strftime(&format, now)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// Year, month (1-12) and day (1-31) of a count of days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// C `strftime` in UTC for the directives chat templates use; unknown directives are kept as written.
pub fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let day_of_year = {
        let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
        before + day + u32::from(is_leap && month > 2)
    };
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('B') => write!(out, "{month_name}"),
            Some('b') | Some('h') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}"),
            Some('T') => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            Some('Z') => write!(out, "UTC"),
            Some('z') => write!(out, "+0000"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// `value` as JSON the way templates' `tojson` writes it (Python's `json.dumps`: `", "` and
/// `": "` separators), for text shown to a model next to what its template renders.
pub fn python_json<T: Serialize + ?Sized>(value: &T) -> String {
    let opts = JsonOpts {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        ensure_ascii: false,
        sort_keys: false,
    };
    let mut out = String::new();
    match write_json(&mut out, &Value::from_serialize(value), &opts, 0) {
        Ok(()) => out,
        Err(_) => serde_json::to_string(&Value::from_serialize(value)).unwrap_or_default(),
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` (so `", "` and `": "` separators, no HTML escaping).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (
                    a.as_str().unwrap_or(",").to_string(),
                    b.as_str().unwrap_or(":").to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
        _ => (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn newline(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Bytes => write_json_str(
            out,
            &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()),
            opts.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                let key = key.as_str().map(str::to_string).unwrap_or_else(|| key.to_string());
                entries.push((key, value));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, value, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push('}');
        }
        ValueKind::Plain | ValueKind::Invalid => write_json_str(out, &v.to_string(), opts.ensure_ascii),
        // ValueKind is non-exhaustive; anything new is written as its string form.
        _ => write_json_str(out, &v.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-23 14:05:09 UTC, a Tuesday.
        let t = 1_721_743_509;
        assert_eq!(strftime("%d %b %Y", t), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %e, %F %T %j %%", t),
            "Tuesday July 23, 2024-07-23 14:05:09 205 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    }

    #[test]
    fn templates_that_read_tools_are_told_apart() {
        let qwen_like = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}\
                         {% for m in messages %}{{ m.tool_calls }}{% endfor %}";
        let t = ChatTemplate::new(qwen_like, "", "").unwrap();
        assert!(t.renders_tools() && t.renders_tool_calls());
        // A loop variable named like it, or the word in text, is not the `tools` variable.
        let t = ChatTemplate::new("{% for tools in messages %}{{ tools }}{% endfor %}tools", "", "").unwrap();
        assert!(!t.renders_tools() && !t.renders_tool_calls());
        assert!(!ChatTemplate::chatml("", "").renders_tools());
    }

    #[test]
    fn python_json_keeps_key_order_and_python_separators() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"type": "function", "b": [1, 2.5, null], "a": "é"}"#).unwrap();
        assert_eq!(
            python_json(&v),
            r#"{"type": "function", "b": [1, 2.5, null], "a": "é"}"#
        );
        // Templates' `tojson` sees maps in the order they were given, as Python dicts keep it.
        let t = ChatTemplate::new("{{ tools[0] | tojson }}", "", "").unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("tools".into(), serde_json::Value::Array(vec![v]));
        let messages: [ChatMessage; 0] = [];
        assert_eq!(
            t.render_with(&messages, false, &extra).unwrap(),
            r#"{"type": "function", "b": [1, 2.5, null], "a": "é"}"#
        );
    }

    #[test]
    fn json_strings_escape_like_python() {
        let mut s = String::new();
        write_json_str(&mut s, "a\"b\\c\n\u{1}é😀", false);
        assert_eq!(s, "\"a\\\"b\\\\c\\n\\u0001é😀\"");
        let mut s = String::new();
        write_json_str(&mut s, "é😀", true);
        assert_eq!(s, "\"\\u00e9\\ud83d\\ude00\"");
    }
}

//! Chat template rendering checked against what Python Jinja2 renders with transformers' settings
//! (expected strings were produced that way): SmolLM2's embedded template, Llama-3, Qwen2 and Mistral styles.

use std::path::PathBuf;

use strata_formats::gguf::GgufFile;
use strata_model::chat_template::{strftime, ChatMessage, ChatTemplate, TemplateError, CHATML_TEMPLATE};

fn cache_file(rel: &str) -> PathBuf {
    let dir = match std::env::var_os("STRATA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/strata"),
    };
    let path = dir.join(rel);
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    path
}

fn one_turn() -> Vec<ChatMessage> {
    vec![ChatMessage::user("Hello")]
}

fn with_system() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("Hello!"),
        ChatMessage::user("Bye"),
    ]
}

const SMOL_DEFAULT_SYSTEM: &str =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

#[test]
fn smollm2_embedded_template_renders_chatml() {
    let gguf = GgufFile::open(cache_file("models/SmolLM2-135M-Instruct.Q4_1.gguf")).expect("open model");
    let t = ChatTemplate::from_gguf(&gguf).expect("template");
    assert!(!t.is_fallback());
    assert_eq!(t.bos_token(), "<|im_start|>");
    assert_eq!(t.eos_token(), "<|im_end|>");

    let user = "<|im_start|>user\nHello<|im_end|>\n";
    assert_eq!(
        t.render(&one_turn(), false).expect("render"),
        format!("{SMOL_DEFAULT_SYSTEM}{user}")
    );
    assert_eq!(
        t.render(&one_turn(), true).expect("render"),
        format!("{SMOL_DEFAULT_SYSTEM}{user}<|im_start|>assistant\n")
    );
    let conversation = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
    assert_eq!(t.render(&with_system(), false).expect("render"), conversation);
    assert_eq!(
        t.render(&with_system(), true).expect("render"),
        format!("{conversation}<|im_start|>assistant\n")
    );
}

const LLAMA3_TEMPLATE: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

fn date_context() -> serde_json::Map<String, serde_json::Value> {
    let mut extra = serde_json::Map::new();
    extra.insert("date_string".into(), "26 Jul 2024".into());
    extra
}

#[test]
fn llama3_style_template() {
    let t = ChatTemplate::new(LLAMA3_TEMPLATE, "<s>", "</s>").expect("compiles");
    let head = "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>";
    let user = "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>";
    let gen = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    assert_eq!(
        t.render_with(&one_turn(), false, &date_context()).expect("render"),
        format!("{head}{user}")
    );
    assert_eq!(
        t.render_with(&one_turn(), true, &date_context()).expect("render"),
        format!("{head}{user}{gen}")
    );

    // Without date_string the template asks strftime_now for today's date.
    let today = strftime(
        "%d %b %Y",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs() as i64,
    );
    let rendered = t.render(&one_turn(), true).expect("render");
    assert!(rendered.contains(&format!("Today Date: {today}\n")), "{rendered}");
}

#[test]
fn llama3_style_template_with_tools_uses_python_json() {
    let t = ChatTemplate::new(LLAMA3_TEMPLATE, "<s>", "</s>").expect("compiles");
    let mut extra = date_context();
    extra.insert(
        "tools".into(),
        serde_json::json!([{"description": "Get the weather", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}]),
    );
    let expected = "<s><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou have access to the following functions:\n\n{\n    \"description\": \"Get the weather\",\n    \"name\": \"get_weather\",\n    \"parameters\": {\n        \"properties\": {\n            \"city\": {\n                \"type\": \"string\"\n            }\n        },\n        \"required\": [\n            \"city\"\n        ],\n        \"type\": \"object\"\n    }\n}\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    assert_eq!(t.render_with(&with_system(), true, &extra).expect("render"), expected);
}

#[test]
fn tojson_without_indent_matches_json_dumps() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(sort_keys=true) }}|{{ s | tojson }}",
        "",
        "",
    )
    .expect("compiles");
    let mut extra = serde_json::Map::new();
    extra.insert(
        "x".into(),
        serde_json::json!({"a": [1, 2.5, true, null], "b": {}, "c": []}),
    );
    extra.insert("s".into(), "<tag> \"q\" é".into());
    let out = t.render_with(&one_turn(), false, &extra).expect("render");
    let x = r#"{"a": [1, 2.5, true, null], "b": {}, "c": []}"#;
    assert_eq!(out, format!(r#"{x}|{x}|"<tag> \"q\" é""#));
}

const QWEN2_TEMPLATE: &str = r#"{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

#[test]
fn qwen2_style_template() {
    let t = ChatTemplate::new(QWEN2_TEMPLATE, "", "<|im_end|>").expect("compiles");
    assert_eq!(
        t.render(&one_turn(), true).expect("render"),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&with_system(), false).expect("render"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
}

/// Block tags on their own lines, no `-`: trim_blocks and lstrip_blocks must behave as in transformers.
const MISTRAL_TEMPLATE: &str = "{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'].strip() }} [/INST]
    {% elif message['role'] == 'assistant' %}
{{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
";

#[test]
fn block_whitespace_and_python_methods() {
    let t = ChatTemplate::new(MISTRAL_TEMPLATE, "<s>", "</s>").expect("compiles");
    let messages = vec![
        ChatMessage::user("  Hi  "),
        ChatMessage::assistant("Hello!"),
        ChatMessage::user("Tell me a joke."),
    ];
    assert_eq!(
        t.render(&messages, true).expect("render"),
        "<s>\n[INST] Hi [/INST]\nHello!</s>\n[INST] Tell me a joke. [/INST]\n"
    );
    assert_eq!(
        t.render(&one_turn(), false).expect("render"),
        "<s>\n[INST] Hello [/INST]\n"
    );
}

#[test]
fn raise_exception_surfaces_the_templates_message() {
    let t = ChatTemplate::new(MISTRAL_TEMPLATE, "<s>", "</s>").expect("compiles");
    match t.render(&with_system(), true) {
        Err(TemplateError::Raised(msg)) => {
            assert_eq!(
                msg,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        }
        other => panic!("expected the template's own error, got {other:?}"),
    }
    let err = t.render(&with_system(), true).expect_err("still an error");
    assert_eq!(
        err.to_string(),
        "Conversation roles must alternate user/assistant/user/assistant/..."
    );
}

#[test]
fn broken_templates_are_reported() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "").expect_err("unclosed for");
    assert!(matches!(err, TemplateError::Syntax(_)), "{err:?}");
    let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", "", "").expect("compiles");
    assert!(matches!(t.render(&one_turn(), false), Err(TemplateError::Render(_))));
}

#[test]
fn model_without_template_falls_back_to_chatml() {
    // The llama-bpe vocab test file carries no tokenizer.chat_template.
    let gguf = GgufFile::open(cache_file("vocab/ggml-vocab-llama-bpe.gguf")).expect("open vocab");
    assert!(gguf.get_str("tokenizer.chat_template").is_none());
    let t = ChatTemplate::from_gguf(&gguf).expect("fallback");
    assert!(t.is_fallback());
    assert_eq!(t.source(), CHATML_TEMPLATE);
    assert_eq!(t.bos_token(), "<|begin_of_text|>");
    assert_eq!(
        t.render(&with_system(), true).expect("render"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn tokenizer_config_templates() {
    let dir = std::env::temp_dir().join(format!("strata-chat-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    let single = dir.join("single.json");
    let config = serde_json::json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}",
    });
    std::fs::write(&single, config.to_string()).expect("write");
    let t = ChatTemplate::from_tokenizer_config(&single).expect("load");
    assert_eq!(t.render(&one_turn(), false).expect("render"), "<s>user: Hello</s>");

    let named = dir.join("named.json");
    let config = serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "D{{ messages | length }}"},
            {"name": "tool_use", "template": "T{{ messages | length }}"},
        ],
    });
    std::fs::write(&named, config.to_string()).expect("write");
    assert_eq!(
        ChatTemplate::from_tokenizer_config(&named)
            .expect("load")
            .render(&with_system(), false)
            .expect("render"),
        "D4"
    );
    let tool = ChatTemplate::from_tokenizer_config_named(&named, Some("tool_use")).expect("load");
    assert_eq!(tool.render(&one_turn(), false).expect("render"), "T1");
    let missing = ChatTemplate::from_tokenizer_config_named(&named, Some("rag")).expect_err("no such template");
    assert!(missing.to_string().contains("default, tool_use"), "{missing}");

    let none = dir.join("none.json");
    std::fs::write(&none, r#"{"eos_token": "</s>"}"#).expect("write");
    let fallback = ChatTemplate::from_tokenizer_config(&none).expect("load");
    assert!(fallback.is_fallback());
    assert_eq!(fallback.eos_token(), "</s>");

    let err = ChatTemplate::from_tokenizer_config(dir.join("absent.json")).expect_err("missing file");
    assert!(matches!(err, TemplateError::Io { .. }), "{err:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

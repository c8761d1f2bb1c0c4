//! `response_format` (chat and completions; the Responses API's `text.format` arrives as one):
//! parsed into the engine's [`OutputConstraint`] and checked to compile against the served vocabulary.

use std::sync::Arc;

use serde_json::{Map, Value};
use strata_engine::{EngineHandle, GrammarCompiler, OutputConstraint};
use strata_model::tokenizer::Tokenizer;

use crate::error::ApiError;

/// Longest schema name OpenAI accepts.
pub const MAX_SCHEMA_NAME_CHARS: usize = 64;

/// The served model's grammar compiler, or why it has none: the engine's own (built on the
/// first request that needs it), or one of its own in tests without an engine.
pub enum GrammarCheck {
    Engine(EngineHandle),
    Own(Result<GrammarCompiler, String>),
}

impl GrammarCheck {
    /// The check of the engine's own compiler (the one that will constrain the requests).
    pub fn new(engine: &EngineHandle) -> Self {
        GrammarCheck::Engine(engine.clone())
    }

    /// The check of a compiler for `tokenizer`'s vocabulary (tests without an engine).
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Self {
        GrammarCheck::Own(GrammarCompiler::new(Arc::new(tokenizer.clone())))
    }

    /// One that refuses every format but `text` (tests of the other fields need no vocabulary).
    #[cfg(test)]
    pub(crate) fn unavailable() -> Self {
        GrammarCheck::Own(Err("no vocabulary in this test".into()))
    }

    fn compiler(&self) -> Result<&GrammarCompiler, String> {
        match self {
            GrammarCheck::Engine(engine) => engine.grammar_compiler().map_err(|e| e.to_string()),
            GrammarCheck::Own(compiler) => compiler.as_ref().map_err(String::clone),
        }
    }

    /// 400 naming `param` with llguidance's reason when the engine could not hold output to
    /// `constraint` (a schema it cannot compile, or a model without an end-of-sequence token).
    pub fn check(&self, constraint: &OutputConstraint, param: &str) -> Result<(), ApiError> {
        let compiler = self
            .compiler()
            .map_err(|why| ApiError::invalid_field(param, format!("this model cannot constrain its output: {why}")))?;
        match compiler.matcher(constraint) {
            Ok(_) => Ok(()),
            Err(why) => Err(ApiError::invalid_field(
                param,
                format!("`{param}` cannot be used to constrain the output: {why}"),
            )),
        }
    }
}

/// What a format object asks of the output: `text` (nothing: `None`), `json_object` or
/// `json_schema`, checked field by field (400 naming the field, e.g.
/// `response_format.json_schema.name`) and, for a schema, compiled by `grammar` (400 naming the
/// schema with llguidance's reason).
pub fn output_constraint(format: &Value, grammar: &GrammarCheck) -> Result<Option<OutputConstraint>, ApiError> {
    let param = "response_format";
    let Some(format) = format.as_object() else {
        return Err(ApiError::invalid_field(
            param,
            format!("`{param}` must be an object like {{\"type\": \"json_object\"}}"),
        ));
    };
    let kinds = "`text`, `json_object` or `json_schema`";
    let constraint = match format.get("type") {
        Some(Value::String(kind)) if kind == "text" => return Ok(None),
        Some(Value::String(kind)) if kind == "json_object" => return Ok(Some(OutputConstraint::JsonObject)),
        Some(Value::String(kind)) if kind == "json_schema" => {
            let inner = format!("{param}.json_schema");
            match format.get("json_schema") {
                Some(Value::Object(fields)) => json_schema(fields, &inner)?,
                _ => {
                    return Err(ApiError::invalid_field(
                        inner.clone(),
                        format!("`{inner}` is required with type `json_schema`: an object with `name` and `schema`"),
                    ))
                }
            }
        }
        Some(Value::String(kind)) => {
            return Err(ApiError::invalid_field(
                format!("{param}.type"),
                format!("`{param}.type` is `{kind}`; it must be {kinds}"),
            ))
        }
        _ => {
            return Err(ApiError::invalid_field(
                format!("{param}.type"),
                format!("`{param}.type` is required: {kinds}"),
            ))
        }
    };
    grammar.check(&constraint, &format!("{param}.json_schema.schema"))?;
    Ok(Some(constraint))
}

/// The schema of a `json_schema` format whose fields (`name`, `schema`, `strict`,
/// `description`) are `fields`, named `param` in errors.
fn json_schema(fields: &Map<String, Value>, param: &str) -> Result<OutputConstraint, ApiError> {
    let name_param = format!("{param}.name");
    let name_ok = |n: &str| {
        (1..=MAX_SCHEMA_NAME_CHARS).contains(&n.len())
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    match fields.get("name") {
        Some(Value::String(n)) if name_ok(n) => {}
        Some(_) => {
            return Err(ApiError::invalid_field(
                name_param.clone(),
                format!("`{name_param}` must be 1 to {MAX_SCHEMA_NAME_CHARS} of a-z, A-Z, 0-9, _ and -"),
            ))
        }
        None => {
            return Err(ApiError::invalid_field(
                name_param.clone(),
                format!("`{name_param}` is required"),
            ))
        }
    }
    for (field, kind, ok) in [
        (
            "strict",
            "true or false",
            fields.get("strict").is_none_or(|v| v.is_boolean() || v.is_null()),
        ),
        (
            "description",
            "a string",
            fields.get("description").is_none_or(|v| v.is_string() || v.is_null()),
        ),
    ] {
        if !ok {
            let p = format!("{param}.{field}");
            return Err(ApiError::invalid_field(p.clone(), format!("`{p}` must be {kind}")));
        }
    }
    let schema_param = format!("{param}.schema");
    match fields.get("schema") {
        Some(schema @ Value::Object(_)) => Ok(OutputConstraint::JsonSchema(schema.clone())),
        Some(_) => Err(ApiError::invalid_field(
            schema_param.clone(),
            format!("`{schema_param}` must be a JSON Schema object"),
        )),
        None => Err(ApiError::invalid_field(
            schema_param.clone(),
            format!("`{schema_param}` is required: the JSON Schema the output must match"),
        )),
    }
}

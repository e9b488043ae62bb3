//! The Anthropic-compatible API: `POST /v1/messages` (streaming and not) and
//! `POST /v1/messages/count_tokens`. Reasoning comes back as `thinking` blocks.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::{GenerateRequest, SamplingParams};
use futures_util::stream::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::answer::{self, Answer, Finish, Settings, Step, TemplateTool};
use crate::error::{parse, AnthropicError, ApiError};
use crate::images::Images;
use crate::job::{ClampedBy, Prompt};
use crate::tool_choice::{self, ToolChoice};
use crate::AppState;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    /// tool_result blocks carry their output here (a string or text blocks).
    #[serde(default)]
    content: Option<Box<Content>>,
    /// tool_use blocks (earlier assistant turns).
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    /// tool_result blocks: the tool_use they answer.
    #[serde(default)]
    tool_use_id: Option<String>,
    /// tool_reference blocks (in a tool_result): the deferred tool they load.
    #[serde(default)]
    tool_name: Option<String>,
    /// image blocks: `{"type": "base64", "media_type", "data"}` (or a `url`, refused).
    #[serde(default)]
    source: Option<ImageSource>,
}

#[derive(Debug, Deserialize)]
struct ImageSource {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    url: Option<String>,
}

/// An image block at `path` into `images`.
fn image_block(b: &Block, images: &mut Images, path: &str) -> Result<(), ApiError> {
    match b.source.as_ref() {
        Some(ImageSource { url: Some(url), .. }) => images.url(url, &format!("{path}.source.url")),
        Some(s) if s.kind == "base64" || s.data.is_some() => {
            images.base64(s.media_type.as_deref(), s.data.as_deref().unwrap_or_default(), &format!("{path}.source"))
        }
        _ => images.base64(None, "", &format!("{path}.source")),
    }
}

#[derive(Debug, Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
    /// Left out of the prompt's tool list until a `tool_reference` loads it (tool search).
    #[serde(default)]
    defer_loading: bool,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// `thinking`: `enabled` or `adaptive` (the model decides: Qwen thinks) turn the model's
/// thinking on, `disabled` off; without it the model does not think (Anthropic's default).
/// `display: omitted` keeps the thinking out of the answer (its blocks come back empty).
#[derive(Debug, Deserialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    display: Option<String>,
}

/// How the answer shows the model's thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// In thinking blocks.
    Full,
    /// As empty thinking blocks (`display: omitted`).
    Omitted,
    /// Not at all: the request did not ask for thinking.
    Hidden,
}

/// `output_config`: of what Claude Code sends, `effort` is read (`low` turns thinking off).
#[derive(Debug, Default, Deserialize)]
struct OutputConfig {
    #[serde(default)]
    effort: Option<String>,
}

/// Fields both endpoints read.
#[derive(Debug, Deserialize)]
struct PromptPart {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    thinking: Option<Thinking>,
    #[serde(default)]
    output_config: Option<OutputConfig>,
    #[serde(default)]
    tools: Vec<Tool>,
    /// `none` hides the tools; `any` or a named tool holds the answer to calls.
    #[serde(default)]
    tool_choice: Option<Value>,
    // Accepted and not used (nothing to do for a local model): `metadata`,
    // `context_management`, `cache_control` on blocks, `service_tier`, `container`, `mcp_servers`.
}

#[derive(Debug, Deserialize)]
struct Generation {
    max_tokens: usize,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i32>,
    #[serde(default)]
    stream: bool,
}

fn text_of(content: &Content) -> String {
    match content {
        Content::Text(t) => t.clone(),
        Content::Blocks(blocks) => blocks
            .iter()
            .map(|b| match (b.kind.as_str(), &b.text, &b.content) {
                ("text", Some(t), _) => t.clone(),
                ("tool_result", _, Some(c)) => text_of(c),
                _ => String::new(),
            })
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// A tool_result's text. A `tool_reference` in it (Claude Code's ToolSearch loading a deferred
/// tool) renders that tool's definition as ToolSearch tells the model to expect it, a
/// `<functions>` block of `<function>{"description", "name", "parameters"}</function>` lines:
/// the tool list at the top of the prompt never changes, so everything before the result stays
/// in the prompt cache.
fn tool_result_text(
    content: &Content,
    tools: &[Tool],
    path: &str,
    images: &mut Images,
) -> Result<(String, Vec<usize>), ApiError> {
    let Content::Blocks(blocks) = content else { return Ok((text_of(content), vec![])) };
    let mut at = Vec::new();
    let mut out = String::new();
    let mut functions: Vec<String> = Vec::new();
    let flush = |out: &mut String, functions: &mut Vec<String>| {
        if !functions.is_empty() {
            out.push_str(&format!("<functions>\n{}\n</functions>", functions.join("\n")));
            functions.clear();
        }
    };
    for (k, b) in blocks.iter().enumerate() {
        match (b.kind.as_str(), &b.text) {
            ("tool_reference", _) => {
                let tool = referenced_tool(b, tools, &format!("{path}.{k}"))?;
                let definition = serde_json::json!({
                    "description": tool.description,
                    "name": tool.name,
                    "parameters": tool.input_schema.clone().unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
                });
                functions.push(format!("<function>{}</function>", engine::tokenizer::python_json(&definition)));
            }
            ("text", Some(t)) => {
                flush(&mut out, &mut functions);
                out.push_str(t);
            }
            ("image", _) => {
                flush(&mut out, &mut functions);
                image_block(b, images, &format!("{path}.{k}"))?;
                at.push(out.len());
            }
            _ => {}
        }
    }
    flush(&mut out, &mut functions);
    Ok((out, at))
}

/// The request's tool a `tool_reference` block (at `path`) names.
fn referenced_tool<'t>(block: &Block, tools: &'t [Tool], path: &str) -> Result<&'t Tool, ApiError> {
    let name = block.tool_name.as_deref().unwrap_or_default();
    tools.iter().find(|t| t.name == name).ok_or_else(|| {
        ApiError::bad_request(format!("{path}.tool_name: `{name}` is not one of the request's tools"))
            .with_param(&format!("{path}.tool_name"))
    })
}

/// The deferred tools that `tool_reference` blocks in the messages load, in the template's
/// form: the answer may call them.
fn loaded_tools(p: &PromptPart) -> Vec<Value> {
    let mut names: Vec<&str> = Vec::new();
    for m in &p.messages {
        let Content::Blocks(blocks) = &m.content else { continue };
        for b in blocks {
            if let (Some(Content::Blocks(inner)), "tool_result") = (b.content.as_deref(), b.kind.as_str()) {
                names
                    .extend(inner.iter().filter(|c| c.kind == "tool_reference").filter_map(|c| c.tool_name.as_deref()));
            }
        }
    }
    p.tools.iter().filter(|t| t.defer_loading && names.contains(&t.name.as_str())).map(template_tool).collect()
}

fn template_tool(t: &Tool) -> Value {
    serde_json::to_value(TemplateTool::function(&t.name, t.description.clone(), t.input_schema.clone()))
        .unwrap_or(Value::Null)
}

/// Claude Code's first system block is an attribution line for Anthropic's billing
/// (`x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;`) that changes with the client's
/// version and build: first in the prompt, it would make every cached prefix miss. It tells
/// the model nothing, so it is left out.
fn system_text(system: &Content) -> String {
    let billing = |t: &str| t.trim_start().starts_with("x-anthropic-billing-header:");
    match system {
        Content::Text(t) if billing(t) => String::new(),
        Content::Text(t) => t.clone(),
        Content::Blocks(blocks) => blocks
            .iter()
            .filter(|b| b.kind == "text")
            .filter_map(|b| b.text.as_deref())
            .filter(|t| !billing(t))
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// A block with content the model cannot see (images, documents, ...): refused rather than
/// silently dropped. Thinking blocks of earlier turns and server tool blocks carry nothing the
/// prompt needs.
fn unseen(b: &Block) -> bool {
    !matches!(
        b.kind.as_str(),
        "text"
            | "tool_use"
            | "tool_result"
            | "thinking"
            | "redacted_thinking"
            | "server_tool_use"
            | "web_search_tool_result"
    )
}

/// The path and type of the first block among `blocks` (at `path`) the model cannot see,
/// looking into tool results too (Claude Code's Read of an image answers with one inside a
/// `tool_result`: dropping it would answer as if the tool returned nothing).
fn unseen_in(blocks: &[Block], path: &str, sees: bool) -> Option<(String, String)> {
    let seen = |kind: &str| sees && kind == "image";
    blocks.iter().enumerate().find_map(|(j, b)| {
        if unseen(b) && !seen(&b.kind) {
            return Some((format!("{path}.{j}"), b.kind.clone()));
        }
        // A `tool_reference` (Claude Code's ToolSearch naming a deferred tool) carries no
        // content of its own.
        match (b.kind.as_str(), b.content.as_deref()) {
            ("tool_result", Some(Content::Blocks(inner))) => inner
                .iter()
                .enumerate()
                .find(|(_, c)| !matches!(c.kind.as_str(), "text" | "tool_reference") && !seen(&c.kind))
                .map(|(k, c)| (format!("{path}.{j}.content.{k}"), c.kind.clone())),
            _ => None,
        }
    })
}

/// The prompt, and how the answer shows the model's thinking.
fn prompt(p: &PromptPart, choice: &ToolChoice, images: &mut Images) -> Result<(Prompt, Shown), ApiError> {
    if p.messages.is_empty() {
        return Err(ApiError::bad_request("messages: must not be empty").with_param("messages"));
    }
    let mut messages = Vec::new();
    if let Some(system) = &p.system {
        messages.push(ChatMessage::new("system", &system_text(system)));
    }
    for (i, m) in p.messages.iter().enumerate() {
        // Claude Code sends reminders as system-role messages among the turns: system turns,
        // in order.
        if !matches!(m.role.as_str(), "user" | "assistant" | "system") {
            return Err(ApiError::bad_request(format!(
                "messages.{i}.role: must be `user`, `assistant` or `system`, got `{}`",
                m.role
            ))
            .with_param(&format!("messages.{i}.role")));
        }
        if let Content::Blocks(blocks) = &m.content {
            if let Some((at, kind)) = unseen_in(blocks, &format!("messages.{i}.content"), images.sees()) {
                return Err(ApiError::bad_request(format!(
                    "{at}: `{kind}` blocks are not supported: the model reads text only"
                ))
                .with_param(&format!("{at}.type")));
            }
        }
        let Content::Blocks(blocks) = &m.content else {
            messages.push(ChatMessage::new(&m.role, &text_of(&m.content)));
            continue;
        };
        // Tool results become `tool` turns (before the turn's own text, as they render: their
        // images come first too), tool uses the assistant's tool calls.
        let mut turn = ChatMessage::new(&m.role, "");
        for (j, b) in blocks.iter().enumerate() {
            match b.kind.as_str() {
                "tool_use" => turn
                    .tool_calls
                    .push(ToolCall::new(b.name.as_deref().unwrap_or_default(), b.input.clone().unwrap_or_default())),
                "tool_result" => {
                    let path = format!("messages.{i}.content.{j}.content");
                    let (text, at) = match b.content.as_deref() {
                        Some(c) => tool_result_text(c, &p.tools, &path, images)?,
                        None => (String::new(), vec![]),
                    };
                    let mut result = ChatMessage::new("tool", &text);
                    result.tool_call_id = b.tool_use_id.clone();
                    result.images = at;
                    messages.push(result);
                }
                _ => {}
            }
        }
        for (j, b) in blocks.iter().enumerate() {
            match (b.kind.as_str(), &b.text) {
                ("text", Some(t)) => turn.content.push_str(t),
                ("image", _) => {
                    image_block(b, images, &format!("messages.{i}.content.{j}"))?;
                    turn.images.push(turn.content.len());
                }
                _ => {}
            }
        }
        if !turn.content.is_empty() || !turn.tool_calls.is_empty() || !turn.images.is_empty() {
            messages.push(turn);
        }
    }
    let mut vars = serde_json::Map::new();
    // Deferred tools stay out of the list (a tool_reference renders one where it loads it).
    let listed: Vec<Value> = p.tools.iter().filter(|t| !t.defer_loading).map(template_tool).collect();
    let hidden = *choice == ToolChoice::None;
    if !listed.is_empty() && !hidden {
        vars.insert("tools".into(), Value::Array(listed));
    }
    let loaded_tools = if hidden { vec![] } else { loaded_tools(p) };
    let effort = p.output_config.as_ref().and_then(|o| o.effort.as_deref());
    let thinking = match (p.thinking.as_ref().map(|t| t.kind.as_str()), effort) {
        (Some("disabled"), _) | (_, Some("low")) | (None, _) => false,
        (Some("enabled" | "adaptive"), _) => true,
        (Some(other), _) => {
            return Err(ApiError::bad_request(format!(
                "thinking.type: must be `enabled`, `adaptive` or `disabled`, got `{other}`"
            ))
            .with_param("thinking.type"))
        }
    };
    let shown = match p.thinking.as_ref().and_then(|t| t.display.as_deref()) {
        _ if !thinking => Shown::Hidden,
        None | Some("summarized") => Shown::Full,
        Some("omitted") => Shown::Omitted,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "thinking.display: must be `summarized` or `omitted`, got `{other}`"
            ))
            .with_param("thinking.display"))
        }
    };
    vars.insert("enable_thinking".into(), thinking.into());
    Ok((Prompt::Chat { messages, template_vars: vars, loaded_tools }, shown))
}

/// Why the answer ended, in Anthropic's words. Out of tokens is `max_tokens` at the request's
/// own limit and at the server's `--max-output-tokens` (the `x-ferrite-max-tokens-set-by:
/// server` header tells the two apart), and `model_context_window_exceeded` where the context
/// or the memory left no room for more.
fn stop_reason(answer: &Answer) -> &'static str {
    match answer.finish {
        _ if !answer.calls.is_empty() => "tool_use",
        Finish::OutOfTokens(None | Some(ClampedBy::ServerCap)) => "max_tokens",
        Finish::OutOfTokens(Some(ClampedBy::Context | ClampedBy::Memory)) => "model_context_window_exceeded",
        Finish::EndOfTurn => "end_turn",
        Finish::StopSequence => "stop_sequence",
        Finish::GrammarDeadEnd => "grammar_dead_end",
    }
}

pub async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Result<Response, AnthropicError> {
    let p: PromptPart = parse(&body)?;
    let loaded = state.resolve_model(&p.model)?;
    let mut images = Images::new(loaded.worker.info.sees);
    let (prompt, _) = prompt(&p, &ToolChoice::anthropic(p.tool_choice.as_ref())?, &mut images)?;
    let request = GenerateRequest { images: images.into_list(), ..GenerateRequest::greedy(vec![], 1) };
    let running = loaded.worker.run(prompt, request, true).await?;
    Ok(Json(TokenCount { input_tokens: running.prompt_tokens }).into_response())
}

pub async fn messages(State(state): State<AppState>, body: Bytes) -> Result<Response, AnthropicError> {
    let p: PromptPart = parse(&body)?;
    let g: Generation = parse(&body)?;
    let loaded = state.resolve_model(&p.model)?;
    let choice = ToolChoice::anthropic(p.tool_choice.as_ref())?;
    let mut images = Images::new(loaded.worker.info.sees);
    let (prompt, shown) = prompt(&p, &choice, &mut images)?;
    let settings = Settings {
        max_tokens: Some(g.max_tokens),
        max_tokens_field: "max_tokens",
        stop: g.stop_sequences.clone(),
        stop_field: "stop_sequences",
        sampling: SamplingParams {
            temperature: g.temperature.unwrap_or(0.0),
            top_p: g.top_p.unwrap_or(1.0),
            top_k: g.top_k.unwrap_or(0),
            ..Default::default()
        },
        ignore_eos: false,
    };
    let mut request = settings.request(&loaded)?;
    request.grammar = choice.grammar(&tool_choice::offered(&prompt), loaded.worker.info.call_syntax)?;
    request.images = images.into_list();
    let (running, headers) = answer::run(&state, &loaded, prompt, request).await?;
    let head = Head { id: format!("msg_{}", state.next_id()), model: loaded.worker.info.id.clone() };

    if !g.stream {
        let answer = answer::collect(running).await?;
        let mut content = vec![];
        let thinking = match shown {
            Shown::Full => Some(answer.reasoning.clone()),
            Shown::Omitted => Some(String::new()),
            Shown::Hidden => None,
        };
        if let Some(thinking) = thinking.filter(|_| !answer.reasoning.is_empty()) {
            content.push(OutBlock::Thinking { thinking, signature: String::new() });
        }
        if !answer.text.is_empty() || answer.calls.is_empty() {
            content.push(OutBlock::Text { text: answer.text.clone() });
        }
        for (i, c) in answer.calls.iter().enumerate() {
            content.push(OutBlock::ToolUse {
                id: head.tool_use_id(i),
                name: c.name.clone(),
                input: c.arguments.clone(),
            });
        }
        return Ok((headers, Json(head.message(content, Some(&answer), Usage::of(&answer)))).into_response());
    }

    // Streaming: `message_start` once the prefill has begun (its usage then splits the prompt
    // into cached and computed tokens as `message_delta`'s does); a thinking block (if any)
    // then a text block, each opened on its first delta; tool_use blocks as their calls are
    // written.
    let mut blocks = Blocks { head, open: None, index: 0, prompt_tokens: running.prompt_tokens, started: false, shown };
    let stream = answer::steps(running)
        .flat_map(move |step| futures_util::stream::iter(blocks.of(step)))
        .map(|event| Ok::<_, Infallible>(event.sse()));
    Ok((headers, Sse::new(stream).keep_alive(KeepAlive::default())).into_response())
}

/// What every message of one answer repeats.
struct Head {
    id: String,
    model: String,
}

impl Head {
    fn tool_use_id(&self, n: usize) -> String {
        format!("toolu_{}_{n}", self.id)
    }

    /// The message object (whole, or empty in `message_start`).
    fn message(&self, content: Vec<OutBlock>, answer: Option<&Answer>, usage: Usage) -> OutMessage {
        OutMessage {
            id: self.id.clone(),
            kind: "message",
            role: "assistant",
            model: self.model.clone(),
            content,
            stop_reason: answer.map(stop_reason),
            stop_sequence: answer.and_then(|a| a.summary.stop_string.clone()),
            usage,
        }
    }
}

/// A stream's content blocks: which one is open, and the index of the next.
struct Blocks {
    head: Head,
    open: Option<Open>,
    index: usize,
    prompt_tokens: usize,
    /// Whether `message_start` went out.
    started: bool,
    shown: Shown,
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
    ToolUse,
}

impl Blocks {
    fn of(&mut self, step: Step) -> Vec<Event> {
        let mut out = Vec::new();
        if !std::mem::replace(&mut self.started, true) {
            // The prefill's begin comes first; a request that failed before it counts no cache.
            let cached = match step {
                Step::Prefilled(cached) => cached,
                _ => 0,
            };
            let usage = Usage::split(self.prompt_tokens, cached, 0);
            out.push(Event::MessageStart { message: self.head.message(vec![], None, usage) });
            out.push(Event::Ping);
        }
        out.extend(self.events_of(step));
        out
    }

    fn events_of(&mut self, step: Step) -> Vec<Event> {
        match step {
            Step::Prefilled(_) => vec![],
            Step::Reasoning(thinking) => match self.shown {
                Shown::Full => self.delta(Open::Thinking, Delta::Thinking { thinking }),
                // The block is there, its text is not.
                Shown::Omitted => self.open(Open::Thinking),
                Shown::Hidden => vec![],
            },
            Step::Text(text) => self.delta(Open::Text, Delta::Text { text }),
            // A tool_use block starts with the name and empty input; the input follows in JSON
            // fragments, and it stops at the call's end.
            Step::CallBegin { index, name } => self.open_tool_use(index, name),
            Step::CallArguments { fragment, .. } => vec![self.input(fragment)],
            Step::CallEnd { index, call, streamed } => {
                let mut out = vec![];
                if !streamed {
                    out.extend(self.open_tool_use(index, call.name.clone()));
                    out.push(self.input(call.arguments.to_string()));
                }
                out.extend(self.close());
                out
            }
            Step::Finished(answer) => {
                let mut out = self.close();
                let delta = MessageDelta {
                    stop_reason: stop_reason(&answer),
                    stop_sequence: answer.summary.stop_string.clone(),
                };
                out.push(Event::MessageDelta { delta, usage: Usage::of(&answer) });
                out.push(Event::MessageStop);
                out
            }
            Step::Failed(e) => vec![Event::Error { error: ErrorBody { kind: "api_error", message: e.message } }],
        }
    }

    fn delta(&mut self, kind: Open, delta: Delta) -> Vec<Event> {
        let mut out = self.open(kind);
        out.push(Event::ContentBlockDelta { index: self.index, delta });
        out
    }

    /// Opens a thinking or text block, unless it is the one open.
    fn open(&mut self, kind: Open) -> Vec<Event> {
        let mut out = vec![];
        if self.open != Some(kind) {
            out.extend(self.close());
            let block = match kind {
                Open::Thinking => OutBlock::Thinking { thinking: String::new(), signature: String::new() },
                _ => OutBlock::Text { text: String::new() },
            };
            out.push(Event::ContentBlockStart { index: self.index, content_block: block });
            self.open = Some(kind);
        }
        out
    }

    fn open_tool_use(&mut self, n: usize, name: String) -> Vec<Event> {
        let mut out = self.close();
        let block = OutBlock::ToolUse { id: self.head.tool_use_id(n), name, input: Value::Object(Default::default()) };
        out.push(Event::ContentBlockStart { index: self.index, content_block: block });
        self.open = Some(Open::ToolUse);
        out
    }

    fn input(&self, partial_json: String) -> Event {
        Event::ContentBlockDelta { index: self.index, delta: Delta::InputJson { partial_json } }
    }

    fn close(&mut self) -> Vec<Event> {
        match self.open.take() {
            Some(_) => {
                self.index += 1;
                vec![Event::ContentBlockStop { index: self.index - 1 }]
            }
            None => vec![],
        }
    }
}

#[derive(Serialize)]
struct TokenCount {
    input_tokens: usize,
}

#[derive(Serialize)]
struct OutMessage {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: String,
    content: Vec<OutBlock>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<String>,
    usage: Usage,
}

/// A content block of the answer.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutBlock {
    Text { text: String },
    Thinking { thinking: String, signature: String },
    ToolUse { id: String, name: String, input: Value },
}

/// The streamed events; the SSE event's name is the payload's `type`.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event {
    MessageStart { message: OutMessage },
    Ping,
    ContentBlockStart { index: usize, content_block: OutBlock },
    ContentBlockDelta { index: usize, delta: Delta },
    ContentBlockStop { index: usize },
    MessageDelta { delta: MessageDelta, usage: Usage },
    MessageStop,
    Error { error: ErrorBody },
}

impl Event {
    fn sse(&self) -> SseEvent {
        let data = serde_json::to_value(self).unwrap_or(Value::Null);
        let name = data["type"].as_str().unwrap_or("error").to_string();
        SseEvent::default().event(name).data(data.to_string())
    }
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum Delta {
    #[serde(rename = "text_delta")]
    Text { text: String },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: String },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: String },
}

#[derive(Serialize)]
struct MessageDelta {
    stop_reason: &'static str,
    stop_sequence: Option<String>,
}

#[derive(Serialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: &'static str,
    message: String,
}

/// Anthropic's usage: `input_tokens` are the prompt tokens computed for this request, and
/// `cache_read_input_tokens` those restored from the prompt cache (the three input counts add
/// up to the prompt). Ferrite caches every prompt by itself, so nothing counts as cache creation.
#[derive(Default, Serialize)]
struct Usage {
    input_tokens: usize,
    output_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_creation_input_tokens: Option<usize>,
}

impl Usage {
    fn of(answer: &Answer) -> Self {
        let u = &answer.summary.usage;
        Usage::split(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
    }

    /// `prompt` tokens of which `cached` came from the prompt cache, and `output` generated.
    fn split(prompt: usize, cached: usize, output: usize) -> Self {
        Usage {
            input_tokens: prompt - cached.min(prompt),
            output_tokens: output,
            cache_read_input_tokens: Some(cached),
            cache_creation_input_tokens: Some(0),
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn message_bodies_never_panic(body in crate::fuzz::body()) {
            let body = Bytes::from(body);
            if let Ok(p) = parse::<PromptPart>(&body) {
                if let Err(e) = ToolChoice::anthropic(p.tool_choice.as_ref()).and_then(|c| prompt(&p, &c, &mut Images::new(true)).map(|_| ())) {
                    prop_assert!(e.status.is_client_error(), "{}", e.message);
                }
            }
            let _ = parse::<Generation>(&body);
        }
    }
}

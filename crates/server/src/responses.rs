//! OpenAI's Responses API, `POST /v1/responses` (the only wire API Codex CLI speaks),
//! stateless: every request carries its whole history (`store` is not honoured, and
//! `previous_response_id` is refused saying so). Input items become one chat prompt; the
//! answer comes back as output items (reasoning, message, function calls), streamed with the
//! Responses event sequence or as one response object. Custom (free-form) tools, Codex's
//! `exec` and `apply_patch`, are offered to the model as functions with one string argument.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::{FinishReason, GenerateRequest, SamplingParams};
use futures_util::stream::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{parse, ApiError};
use crate::openai::Content;
use crate::tools::{CallEvent, ParsedCall};
use crate::worker::{JobEvent, Prompt, Running};
use crate::AppState;

/// What a Responses request carries that Ferrite reads. Also accepted and not used (nothing to
/// do for a local, stateless model): `store`, `include`, `prompt_cache_key`, `metadata`,
/// `parallel_tool_calls` (several calls in one turn are always allowed), `text`, `truncation`,
/// `service_tier`, `user`.
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    #[serde(default)]
    instructions: Option<String>,
    input: Input,
    #[serde(default)]
    tools: Vec<Tool>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    reasoning: Option<Reasoning>,
    #[serde(default)]
    max_output_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    previous_response_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// One input item. Messages may omit `type`; item types that hold nothing the model reads
/// (web search calls, images, ...) are refused by name.
#[derive(Debug, Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
    /// function_call: the function, its arguments (a JSON document in a string) and call id.
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    /// custom_tool_call: the tool's free-text input.
    #[serde(default)]
    input: Option<String>,
    #[serde(default)]
    call_id: Option<String>,
    /// function_call_output and custom_tool_call_output: what the tool returned (a string,
    /// or content parts).
    #[serde(default)]
    output: Option<Content>,
    /// additional_tools (Codex 0.169 sends its tools this way, not in `tools`).
    #[serde(default)]
    tools: Vec<Tool>,
}

#[derive(Debug, Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
    /// A `custom` tool's input format: free text, or text in a grammar (`{type: grammar,
    /// syntax, definition}`).
    #[serde(default)]
    format: Option<Value>,
    /// A `namespace` tool's members.
    #[serde(default)]
    tools: Vec<Tool>,
}

/// The tools a request offers, as the chat template shows them to the model.
#[derive(Debug, Default)]
struct Offered {
    /// Chat-template tool definitions (`{type: function, function: {name, description, parameters}}`).
    tools: Vec<Value>,
    /// Custom (free-form) tools: offered as a function with one string parameter, `input`,
    /// and answered as `custom_tool_call` items (Codex's `exec` and `apply_patch` are custom).
    custom: HashSet<String>,
    /// Tools of types the server cannot offer a model (web search, ...), by name.
    ignored: Vec<String>,
}

impl Offered {
    /// Adds `tools` (namespaces opened: a call names the member alone).
    fn add(&mut self, tools: &[Tool]) {
        for t in tools {
            match (t.kind.as_str(), &t.name) {
                ("function", Some(name)) => self.tools.push(json!({"type": "function", "function": {
                    "name": name, "description": t.description,
                    "parameters": t.parameters.clone().unwrap_or(json!({"type": "object", "properties": {}}))}})),
                ("custom", Some(name)) => {
                    self.tools.push(custom_as_function(name, t));
                    self.custom.insert(name.clone());
                }
                ("namespace", _) => self.add(&t.tools),
                (kind, name) => self.ignored.push(name.clone().unwrap_or_else(|| kind.to_string())),
            }
        }
    }
}

/// A custom tool as the model sees it: a function whose one argument, `input`, is the free
/// text the tool takes (the grammar it must follow, if any, is in the description).
fn custom_as_function(name: &str, tool: &Tool) -> Value {
    let mut description = tool.description.clone().unwrap_or_default();
    let grammar = tool.format.as_ref().filter(|f| f["type"] == "grammar");
    let input = match grammar {
        Some(f) => format!(
            "The tool's input, raw text (not JSON) in this {} grammar:\n{}",
            f["syntax"].as_str().unwrap_or("formal"),
            f["definition"].as_str().unwrap_or_default()
        ),
        None => "The tool's input, raw text (not JSON).".to_string(),
    };
    if !description.is_empty() {
        description.push_str("\n\n");
    }
    description.push_str("Pass the input as the `input` argument.");
    json!({"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "description": input}}, "required": ["input"]}}})
}

/// The text a custom tool receives from a call the model wrote as a function call.
fn custom_input(arguments: &Value) -> String {
    match arguments {
        Value::Object(map) => match map.get("input") {
            Some(Value::String(s)) if map.len() == 1 => s.clone(),
            _ => arguments.to_string(),
        },
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[derive(Debug, Deserialize)]
struct Reasoning {
    #[serde(default)]
    effort: Option<String>,
}

fn text_of(content: &Option<Content>) -> String {
    match content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => parts
            .iter()
            .filter(|p| matches!(p.kind.as_str(), "input_text" | "output_text" | "text" | "summary_text"))
            .filter_map(|p| p.text.clone())
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// The chat prompt of a request, and the tools it offers (their chat-template form taken).
fn prompt(req: &ResponsesRequest) -> Result<(Prompt, Offered), ApiError> {
    if req.previous_response_id.is_some() {
        return Err(ApiError::bad_request(
            "previous_response_id: Ferrite keeps no responses (store is not supported); send the whole history in `input`",
        )
        .with_param("previous_response_id"));
    }
    let mut messages = Vec::new();
    if let Some(instructions) = req.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.push(ChatMessage::new("system", instructions));
    }
    let items = match &req.input {
        Input::Text(t) => {
            messages.push(ChatMessage::new("user", t));
            &[][..]
        }
        Input::Items(items) => items.as_slice(),
    };
    for (i, item) in items.iter().enumerate() {
        match item.kind.as_deref().unwrap_or("message") {
            "message" => {
                let role = match item.role.as_deref() {
                    Some("developer" | "system") => "system",
                    Some("user") => "user",
                    Some("assistant") => "assistant",
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "input[{i}].role: must be `user`, `assistant`, `system` or `developer`, got `{}`",
                            other.unwrap_or("nothing")
                        ))
                        .with_param(&format!("input[{i}].role")))
                    }
                };
                if let Some(Content::Parts(parts)) = &item.content {
                    if let Some((j, p)) = parts.iter().enumerate().find(|(_, p)| !p.kind.ends_with("text")) {
                        return Err(ApiError::bad_request(format!(
                            "input[{i}].content[{j}]: `{}` parts are not supported: the model reads text only",
                            p.kind
                        ))
                        .with_param(&format!("input[{i}].content[{j}].type")));
                    }
                }
                messages.push(ChatMessage::new(role, &text_of(&item.content)));
            }
            "function_call" | "custom_tool_call" => {
                let arguments = match (item.kind.as_deref(), &item.arguments) {
                    (Some("custom_tool_call"), _) => json!({"input": item.input.clone().unwrap_or_default()}),
                    (_, Some(a)) => serde_json::from_str(a).unwrap_or(Value::String(a.clone())),
                    (_, None) => json!({}),
                };
                let call = ToolCall::new(item.name.as_deref().unwrap_or_default(), arguments);
                // Calls of one turn join the assistant message before them.
                match messages.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                    _ => {
                        let mut turn = ChatMessage::new("assistant", "");
                        turn.tool_calls.push(call);
                        messages.push(turn);
                    }
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let mut result = ChatMessage::new("tool", &text_of(&item.output));
                result.tool_call_id = item.call_id.clone();
                messages.push(result);
            }
            // Earlier reasoning: the templates drop it from history, as for chat.
            "reasoning" => {}
            // Tools declared in the input (read below).
            "additional_tools" => {}
            other => {
                return Err(ApiError::bad_request(format!(
                    "input[{i}]: `{other}` items are not supported (messages, function and custom tool calls and their outputs, and reasoning are)"
                ))
                .with_param(&format!("input[{i}].type")))
            }
        }
    }
    if messages.iter().all(|m| m.role == "system") {
        return Err(ApiError::bad_request("input: no user or assistant turn").with_param("input"));
    }
    let mut vars = serde_json::Map::new();
    let mut offered = Offered::default();
    offered.add(&req.tools);
    for item in items.iter().filter(|i| i.kind.as_deref() == Some("additional_tools")) {
        offered.add(&item.tools);
    }
    if req.tool_choice.as_ref().and_then(Value::as_str) == Some("none") {
        offered.tools.clear();
    }
    if !offered.tools.is_empty() {
        vars.insert("tools".into(), Value::Array(std::mem::take(&mut offered.tools)));
    }
    if matches!(req.reasoning.as_ref().and_then(|r| r.effort.as_deref()), Some("none" | "minimal")) {
        vars.insert("enable_thinking".into(), false.into());
    }
    Ok((Prompt::Chat { messages, template_vars: vars }, offered))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// What the answer has become so far, as Responses output items.
#[derive(Default)]
struct Answer {
    reasoning: String,
    text: String,
    calls: Vec<ParsedCall>,
    /// The names of the custom tools offered (their calls are `custom_tool_call` items).
    custom: Arc<HashSet<String>>,
}

impl Answer {
    fn new(custom: Arc<HashSet<String>>) -> Self {
        Answer { custom, ..Default::default() }
    }

    fn is_custom(&self, call: &ParsedCall) -> bool {
        self.custom.contains(&call.name)
    }

    fn output(&self, id: &str) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.reasoning.is_empty() {
            out.push(reasoning_item(id, &self.reasoning));
        }
        if !self.text.is_empty() || self.calls.is_empty() {
            out.push(message_item(id, &self.text, "completed"));
        }
        out.extend(self.calls.iter().enumerate().map(|(i, c)| call_item(id, i, c, self.is_custom(c), "completed")));
        out
    }
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{id}"), "summary": [{"type": "summary_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({"type": "message", "id": format!("msg_{id}"), "status": status, "role": "assistant", "content": content})
}

/// A tool call as an output item: `function_call` (arguments: a JSON document in a string) or
/// `custom_tool_call` (input: the free text).
fn call_item(id: &str, i: usize, c: &ParsedCall, custom: bool, status: &str) -> Value {
    let done = status == "completed";
    if custom {
        let input = if done { custom_input(&c.arguments) } else { String::new() };
        return json!({"type": "custom_tool_call", "id": call_item_id(id, i, true), "call_id": format!("call_{id}_{i}"),
                      "name": c.name, "input": input, "status": status});
    }
    let arguments = if done { c.arguments.to_string() } else { String::new() };
    json!({"type": "function_call", "id": call_item_id(id, i, false), "call_id": format!("call_{id}_{i}"),
           "name": c.name, "arguments": arguments, "status": status})
}

fn call_item_id(id: &str, i: usize, custom: bool) -> String {
    format!("{}_{id}_{i}", if custom { "ctc" } else { "fc" })
}

/// The response object (also the payload of `response.created` and `response.completed`).
fn response_object(id: &str, model: &str, created: u64, status: &str, output: Vec<Value>, usage: Value) -> Value {
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    json!({"id": format!("resp_{id}"), "object": "response", "created_at": created, "status": status,
           "model": model, "output": output, "usage": usage, "incomplete_details": incomplete, "error": null,
           "parallel_tool_calls": true, "tool_choice": "auto", "tools": []})
}

fn usage(u: &engine::generate::Usage, reasoning: usize) -> Value {
    json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
           "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

pub async fn responses(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse(&body)?;
    let loaded = state.resolve_model(&req.model)?;
    let (prompt, offered) = prompt(&req)?;
    let (ignored_tools, custom) = (offered.ignored, Arc::new(offered.custom));
    let max_tokens = req.max_output_tokens.unwrap_or(crate::openai::DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(ApiError::bad_request("max_output_tokens: must be at least 1").with_param("max_output_tokens"));
    }
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(0.0),
        top_p: req.top_p.unwrap_or(1.0),
        ..Default::default()
    };
    sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
    let request =
        GenerateRequest { sampling, draft_depth: loaded.draft_depth, ..GenerateRequest::greedy(vec![], max_tokens) };
    let Running { events: mut rx, max_tokens, clamped, guard, .. } = loaded.worker.run(prompt, request, false).await?;
    let mut headers = state.speed_headers(&loaded, max_tokens, clamped);
    if !ignored_tools.is_empty() {
        // Tools the server cannot run were left out of the prompt: say which.
        if let Ok(v) = HeaderValue::from_str(&ignored_tools.join(", ")) {
            headers.insert("x-ferrite-tools-ignored", v);
        }
    }
    let id = format!("{:024}", state.next_id());
    let model = loaded.worker.info.id.clone();
    let created = now();
    let status_of = move |reason: FinishReason| {
        if reason == FinishReason::Length && clamped.is_none() {
            "incomplete"
        } else {
            "completed"
        }
    };

    if !req.stream {
        let mut answer = Answer::new(custom);
        while let Some(event) = rx.recv().await {
            match event {
                JobEvent::Delta { content, reasoning, tool_calls } => {
                    answer.text.push_str(&content);
                    answer.reasoning.push_str(&reasoning);
                    answer.calls.extend(CallEvent::completed(tool_calls));
                }
                JobEvent::Finished { summary, reasoning_tokens } => {
                    drop(guard);
                    let usage = usage(&summary.usage, reasoning_tokens);
                    let body = response_object(
                        &id,
                        &model,
                        created,
                        status_of(summary.finish_reason),
                        answer.output(&id),
                        usage,
                    );
                    return Ok((headers, Json(body)).into_response());
                }
                JobEvent::Failed(e) => return Err(e.into()),
                JobEvent::Started { .. } => {}
            }
        }
        return Err(ApiError::internal("the engine stopped before finishing"));
    }

    let mut stream = EventStream {
        id: id.clone(),
        sequence: 0,
        open: None,
        items: Vec::new(),
        answer: Answer::new(custom),
        calling: None,
    };
    let first = stream.event(
        "response.created",
        json!({"response": response_object(&id, &model, created, "in_progress", vec![], Value::Null)}),
    );
    let events = ReceiverStream::new(rx).flat_map(move |event| {
        let _keep = &guard;
        let out = match event {
            JobEvent::Delta { content, reasoning, tool_calls } => stream.delta(&reasoning, &content, &tool_calls),
            JobEvent::Finished { summary, reasoning_tokens } => {
                let mut out = Vec::new();
                if stream.items.is_empty() && stream.open.is_none() {
                    out.extend(stream.open(Open::Message)); // an answer with nothing in it
                }
                out.extend(stream.close_item());
                let usage = usage(&summary.usage, reasoning_tokens);
                let output = stream.items.clone();
                let response =
                    response_object(&stream.id, &model, created, status_of(summary.finish_reason), output, usage);
                out.push(stream.event("response.completed", json!({"response": response})));
                out
            }
            JobEvent::Failed(e) => vec![stream.event("error", json!({"message": format!("{e:?}")}))],
            JobEvent::Started { .. } => vec![],
        };
        futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>))
    });
    let all = futures_util::stream::once(async move { Ok(first) }).chain(events);
    Ok((headers, Sse::new(all).keep_alive(KeepAlive::default())).into_response())
}

/// The kind of output item being streamed now.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
}

/// The Responses event sequence: items are opened (`output_item.added`), filled by deltas and
/// closed (`output_item.done`) one at a time; every event carries a `sequence_number`.
struct EventStream {
    id: String,
    sequence: u64,
    open: Option<Open>,
    /// Output items closed so far (their index is their position).
    items: Vec<Value>,
    answer: Answer,
    /// The tool call being streamed, if one is.
    calling: Option<Calling>,
}

impl EventStream {
    fn event(&mut self, kind: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseEvent::default().event(kind).data(data.to_string())
    }

    fn index(&self) -> usize {
        self.items.len()
    }

    fn open(&mut self, kind: Open) -> Vec<SseEvent> {
        if self.open == Some(kind) {
            return vec![];
        }
        let mut out = self.close_item();
        self.open = Some(kind);
        let index = self.index();
        match kind {
            Open::Reasoning => {
                let item = json!({"type": "reasoning", "id": format!("rs_{}", self.id), "summary": []});
                out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
                let part = json!({"item_id": format!("rs_{}", self.id), "output_index": index, "summary_index": 0,
                                  "part": {"type": "summary_text", "text": ""}});
                out.push(self.event("response.reasoning_summary_part.added", part));
            }
            Open::Message => {
                let item = message_item(&self.id, "", "in_progress");
                out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
                let part = json!({"item_id": format!("msg_{}", self.id), "output_index": index, "content_index": 0,
                                  "part": {"type": "output_text", "text": "", "annotations": []}});
                out.push(self.event("response.content_part.added", part));
            }
        }
        out
    }

    fn close_item(&mut self) -> Vec<SseEvent> {
        let Some(kind) = self.open.take() else { return vec![] };
        let index = self.index();
        let mut out = Vec::new();
        let item = match kind {
            Open::Reasoning => {
                let (item_id, text) = (format!("rs_{}", self.id), self.answer.reasoning.clone());
                let done = json!({"item_id": item_id, "output_index": index, "summary_index": 0, "text": text});
                out.push(self.event("response.reasoning_summary_text.done", done));
                let part = json!({"item_id": item_id, "output_index": index, "summary_index": 0,
                                  "part": {"type": "summary_text", "text": text}});
                out.push(self.event("response.reasoning_summary_part.done", part));
                reasoning_item(&self.id, &text)
            }
            Open::Message => {
                let (item_id, text) = (format!("msg_{}", self.id), self.answer.text.clone());
                let done = json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text});
                out.push(self.event("response.output_text.done", done));
                let part = json!({"item_id": item_id, "output_index": index, "content_index": 0,
                                  "part": {"type": "output_text", "text": text, "annotations": []}});
                out.push(self.event("response.content_part.done", part));
                message_item(&self.id, &text, "completed")
            }
        };
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.items.push(item);
        out
    }

    fn delta(&mut self, reasoning: &str, content: &str, calls: &[CallEvent]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !reasoning.is_empty() {
            out.extend(self.open(Open::Reasoning));
            self.answer.reasoning.push_str(reasoning);
            let (item_id, index) = (format!("rs_{}", self.id), self.index());
            let delta = json!({"item_id": item_id, "output_index": index, "summary_index": 0, "delta": reasoning});
            out.push(self.event("response.reasoning_summary_text.delta", delta));
        }
        if !content.is_empty() {
            out.extend(self.open(Open::Message));
            self.answer.text.push_str(content);
            let (item_id, index) = (format!("msg_{}", self.id), self.index());
            let delta = json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": content});
            out.push(self.event("response.output_text.delta", delta));
        }
        for event in calls {
            match event {
                CallEvent::Begin { name } => {
                    let call = ParsedCall { name: name.clone(), arguments: Value::Null };
                    out.extend(self.open_call(&call));
                }
                // A custom tool's input is inside the arguments' JSON: it is sent whole at the end.
                CallEvent::Arguments(a) => match &mut self.calling {
                    Some(c) if !c.custom => {
                        c.arguments.push_str(a);
                        let delta = json!({"item_id": c.item_id, "output_index": c.index, "delta": a});
                        out.push(self.event("response.function_call_arguments.delta", delta));
                    }
                    _ => {}
                },
                CallEvent::End(call) => {
                    if self.calling.is_none() {
                        out.extend(self.open_call(call));
                    }
                    out.extend(self.close_call(call));
                }
            }
        }
        out
    }

    /// Opens a call's output item (a `function_call`, or a `custom_tool_call`).
    fn open_call(&mut self, call: &ParsedCall) -> Vec<SseEvent> {
        let mut out = self.close_item();
        let (n, index, custom) = (self.answer.calls.len(), self.index(), self.answer.is_custom(call));
        let added = call_item(&self.id, n, call, custom, "in_progress");
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": added})));
        let item_id = call_item_id(&self.id, n, custom);
        self.calling = Some(Calling { item_id, index, custom, arguments: String::new() });
        out
    }

    /// Closes the open call's item: its whole arguments (as streamed) or custom input.
    fn close_call(&mut self, call: &ParsedCall) -> Vec<SseEvent> {
        let Some(c) = self.calling.take() else { return vec![] };
        let (mut out, n) = (Vec::new(), self.answer.calls.len());
        let mut item = call_item(&self.id, n, call, c.custom, "completed");
        if c.custom {
            let input = custom_input(&call.arguments);
            let delta = json!({"item_id": c.item_id, "output_index": c.index, "delta": input});
            out.push(self.event("response.custom_tool_call_input.delta", delta));
            let done = json!({"item_id": c.item_id, "output_index": c.index, "input": input});
            out.push(self.event("response.custom_tool_call_input.done", done));
        } else {
            // The arguments as streamed (a call that was not streamed sends them whole now).
            let arguments = if c.arguments.is_empty() {
                let whole = call.arguments.to_string();
                let delta = json!({"item_id": c.item_id, "output_index": c.index, "delta": whole});
                out.push(self.event("response.function_call_arguments.delta", delta));
                whole
            } else {
                c.arguments
            };
            item["arguments"] = json!(arguments);
            let done = json!({"item_id": c.item_id, "output_index": c.index, "arguments": arguments});
            out.push(self.event("response.function_call_arguments.done", done));
        }
        out.push(self.event("response.output_item.done", json!({"output_index": c.index, "item": item.clone()})));
        self.items.push(item);
        self.answer.calls.push(call.clone());
        out
    }
}

/// The call whose output item is open in a stream.
struct Calling {
    item_id: String,
    index: usize,
    custom: bool,
    /// The arguments streamed so far.
    arguments: String,
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn responses_bodies_never_panic(body in crate::fuzz::body()) {
            let body = Bytes::from(body);
            if let Ok(req) = parse::<ResponsesRequest>(&body) {
                if let Err(e) = prompt(&req) {
                    prop_assert!(e.status.is_client_error(), "{}", e.message);
                }
            }
        }
    }
}

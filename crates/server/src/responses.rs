//! OpenAI's Responses API, `POST /v1/responses` (the only wire API Codex CLI speaks),
//! stateless: every request carries its whole history (`store` is not honoured, and
//! `previous_response_id` is refused saying so). Input items become one chat prompt; the
//! answer comes back as output items (reasoning, message, function calls), streamed with the
//! Responses event sequence or as one response object. Custom (free-form) tools, Codex's
//! `exec` and `apply_patch`, are offered to the model as functions with one string argument.

use std::collections::HashSet;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::SamplingParams;
use futures_util::stream::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::answer::{self, Answer, Finish, Settings, Step, TemplateTool};
use crate::error::{parse, ApiError};
use crate::images::Images;
use crate::job::Prompt;
use crate::openai::{text_and_images, Content};
use crate::response_format::{self, Expect};
use crate::responses_output::{Event, Incomplete, Item, OutputText, ResponseObject, Sequenced, SummaryText, Usage};
use crate::tool_choice::{self, ToolChoice};
use crate::tools::ParsedCall;
use crate::AppState;

/// What a Responses request carries that Ferrite reads. Also accepted and not used (nothing to
/// do for a local, stateless model): `store`, `include`, `prompt_cache_key`, `metadata`,
/// `truncation`, `service_tier`, `user`.
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    #[serde(default)]
    instructions: Option<String>,
    input: Input,
    #[serde(default)]
    tools: Vec<Tool>,
    /// `none` hides the tools; `required` or a named tool holds the answer to calls.
    #[serde(default)]
    tool_choice: Option<Value>,
    /// With `required`: `false` holds the answer to one call.
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
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
    #[serde(default)]
    text: Option<TextOptions>,
}

/// `text`: the answer's format (`{type: text | json_object | json_schema, name, schema}`, or
/// Ferrite's `{type: grammar, syntax: lark | regex, definition}`).
#[derive(Debug, Deserialize)]
struct TextOptions {
    #[serde(default)]
    format: Option<TextFormat>,
}

#[derive(Debug, Deserialize)]
struct TextFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    schema: Option<Value>,
    #[serde(default)]
    syntax: Option<String>,
    #[serde(default)]
    definition: Option<String>,
}

impl TextFormat {
    /// The grammar the answer is held to, checked up front (a bad schema is a 400).
    fn grammar(&self) -> Result<Option<engine::Grammar>, ApiError> {
        let expect = match self.kind.as_str() {
            "text" => return Ok(None),
            "grammar" => {
                return response_format::custom_grammar(
                    self.syntax.as_deref(),
                    self.definition.as_deref(),
                    "text.format",
                )
                .map(Some)
            }
            "json_object" => Expect::JsonObject,
            "json_schema" => {
                let schema = self.schema.as_ref().ok_or_else(|| {
                    ApiError::bad_request("text.format of type json_schema needs a `schema`").with_param("text.format")
                })?;
                let validator = response_format::validator(schema, "text.format.schema", "text.format.schema")?;
                Expect::Schema {
                    name: self.name.clone().unwrap_or_else(|| "schema".into()),
                    schema: schema.clone(),
                    validator: Box::new(validator),
                }
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "text.format.type `{other}` is not one of text, json_object, json_schema, grammar"
                ))
                .with_param("text.format.type"))
            }
        };
        Ok(Some(expect.grammar()))
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// One input item. Messages may omit `type`; item types that hold nothing the model reads
/// (web search calls, images, ...) are refused by name.
#[derive(Debug, Deserialize)]
struct InputItem {
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
    /// The tools as the chat template shows them.
    tools: Vec<TemplateTool>,
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
                ("function", Some(name)) => {
                    self.tools.push(TemplateTool::function(name, t.description.clone(), t.parameters.clone()))
                }
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
fn custom_as_function(name: &str, tool: &Tool) -> TemplateTool {
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
    let parameters = json!({"type": "object", "properties": {"input": {"type": "string", "description": input}},
                            "required": ["input"]});
    TemplateTool::function(name, Some(description), Some(parameters))
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
fn prompt(req: &ResponsesRequest, choice: &ToolChoice, images: &mut Images) -> Result<(Prompt, Offered), ApiError> {
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
                let seen = |kind: &str| kind.ends_with("text") || (images.sees() && kind == "input_image");
                if let Some(Content::Parts(parts)) = &item.content {
                    if let Some((j, p)) = parts.iter().enumerate().find(|(_, p)| !seen(&p.kind)) {
                        return Err(ApiError::bad_request(format!(
                            "input[{i}].content[{j}]: `{}` parts are not supported: the model reads text only",
                            p.kind
                        ))
                        .with_param(&format!("input[{i}].content[{j}].type")));
                    }
                }
                let mut message = ChatMessage::new(role, &text_of(&item.content));
                if let Some(Content::Parts(parts)) = &item.content {
                    let path = format!("input[{i}].content");
                    (message.content, message.images) = text_and_images(parts, images, &path)?;
                }
                messages.push(message);
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
    if *choice == ToolChoice::None {
        offered.tools.clear();
    }
    if !offered.tools.is_empty() {
        vars.insert("tools".into(), TemplateTool::variable(&offered.tools));
        offered.tools.clear();
    }
    if matches!(req.reasoning.as_ref().and_then(|r| r.effort.as_deref()), Some("none" | "minimal")) {
        vars.insert("enable_thinking".into(), false.into());
    }
    Ok((Prompt::Chat { messages, template_vars: vars, loaded_tools: vec![] }, offered))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub async fn responses(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse(&body)?;
    let loaded = state.resolve_model(&req.model)?;
    let choice = ToolChoice::responses(req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let mut images = Images::new(loaded.worker.info.sees);
    let (prompt, offered) = prompt(&req, &choice, &mut images)?;
    let settings = Settings {
        max_tokens: req.max_output_tokens,
        max_tokens_field: "max_output_tokens",
        stop: vec![],
        stop_field: "stop",
        sampling: SamplingParams {
            temperature: req.temperature.unwrap_or(0.0),
            top_p: req.top_p.unwrap_or(1.0),
            ..Default::default()
        },
        ignore_eos: false,
    };
    let mut request = settings.request(&loaded)?;
    request.grammar = match req.text.as_ref().and_then(|t| t.format.as_ref()) {
        Some(format) => format.grammar()?,
        None => None,
    };
    if let Some(calls) = choice.grammar(&tool_choice::offered(&prompt), loaded.worker.info.call_syntax)? {
        request.grammar = Some(calls);
    }
    request.images = images.into_list();
    let (running, mut headers) = answer::run(&state, &loaded, prompt, request).await?;
    if !offered.ignored.is_empty() {
        // Tools the server cannot run were left out of the prompt: say which.
        if let Ok(v) = HeaderValue::from_str(&offered.ignored.join(", ")) {
            headers.insert("x-ferrite-tools-ignored", v);
        }
    }
    let ids = Ids { id: state.next_id(), custom: offered.custom };
    let head = Head {
        model: loaded.worker.info.id.clone(),
        created: now(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
    };

    if !req.stream {
        let answer = answer::collect(running).await?;
        let output = ids.output(&answer);
        return Ok((headers, Json(head.response(&ids, Some(&answer), output))).into_response());
    }

    let created = head.response(&ids, None, vec![]);
    let mut stream =
        EventStream { ids, head, sequence: 0, open: None, items: Vec::new(), text: String::new(), calling: None };
    let first = stream.event(Event::Created { response: created });
    let events = answer::steps(running).flat_map(move |step| futures_util::stream::iter(stream.of(step)));
    let all = futures_util::stream::once(async move { first }).chain(events).map(Ok::<_, Infallible>);
    Ok((headers, Sse::new(all).keep_alive(KeepAlive::default())).into_response())
}

/// The ids of one response's items, and which tools are custom (their calls are
/// `custom_tool_call` items).
struct Ids {
    id: String,
    custom: HashSet<String>,
}

impl Ids {
    fn reasoning(&self) -> String {
        format!("rs_{}", self.id)
    }

    fn message(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn call(&self, n: usize, custom: bool) -> String {
        format!("{}_{}_{n}", if custom { "ctc" } else { "fc" }, self.id)
    }

    fn call_id(&self, n: usize) -> String {
        format!("call_{}_{n}", self.id)
    }

    fn is_custom(&self, call: &ParsedCall) -> bool {
        self.custom.contains(&call.name)
    }

    fn reasoning_item(&self, text: &str) -> Item {
        Item::Reasoning { id: self.reasoning(), summary: vec![SummaryText::new(text)] }
    }

    /// A message item: completed with its text, or in progress and empty.
    fn message_item(&self, text: Option<&str>) -> Item {
        let (status, content) = match text {
            Some(t) => ("completed", vec![OutputText::new(t)]),
            None => ("in_progress", vec![]),
        };
        Item::Message { id: self.message(), status, role: "assistant", content }
    }

    /// Call `n` as an output item: `function_call` (arguments: a JSON document in a string)
    /// or `custom_tool_call` (input: the free text); in progress (empty) or completed.
    fn call_item(&self, n: usize, call: &ParsedCall, completed: bool) -> Item {
        let status = if completed { "completed" } else { "in_progress" };
        let (call_id, name) = (self.call_id(n), call.name.clone());
        if self.is_custom(call) {
            let input = if completed { custom_input(&call.arguments) } else { String::new() };
            return Item::CustomToolCall { id: self.call(n, true), call_id, name, input, status };
        }
        let arguments = if completed { call.arguments.to_string() } else { String::new() };
        Item::FunctionCall { id: self.call(n, false), call_id, name, arguments, status }
    }

    /// The output items of a whole answer.
    fn output(&self, answer: &Answer) -> Vec<Item> {
        let mut out = Vec::new();
        if !answer.reasoning.is_empty() {
            out.push(self.reasoning_item(&answer.reasoning));
        }
        if !answer.text.is_empty() || answer.calls.is_empty() {
            out.push(self.message_item(Some(&answer.text)));
        }
        out.extend(answer.calls.iter().enumerate().map(|(n, c)| self.call_item(n, c, true)));
        out
    }
}

/// What every response object of one answer repeats.
struct Head {
    model: String,
    created: u64,
    /// As the request asked (the response echoes it).
    parallel_tool_calls: bool,
}

impl Head {
    /// The response object: in progress (no answer yet), or the answer's.
    fn response(&self, ids: &Ids, answer: Option<&Answer>, output: Vec<Item>) -> ResponseObject {
        // Out of tokens (the request's limit, the server's cap, the context or the memory:
        // the `x-ferrite-max-tokens-set-by` header says which) or a grammar that dead-ended:
        // incomplete. An answer that called tools ended for the client to run them.
        let incomplete = match answer {
            Some(a) if !a.calls.is_empty() => None,
            Some(Answer { finish: Finish::OutOfTokens(_), .. }) => Some("max_output_tokens"),
            Some(Answer { finish: Finish::GrammarDeadEnd, .. }) => Some("grammar_dead_end"),
            _ => None,
        };
        let status = match answer {
            None => "in_progress",
            Some(_) if incomplete.is_some() => "incomplete",
            Some(_) => "completed",
        };
        ResponseObject {
            id: format!("resp_{}", ids.id),
            object: "response",
            created_at: self.created,
            status,
            model: self.model.clone(),
            output,
            usage: answer.map(Usage::of),
            incomplete_details: incomplete.map(|reason| Incomplete { reason }),
            error: None,
            parallel_tool_calls: self.parallel_tool_calls,
            store: false,
            tool_choice: "auto",
            tools: vec![],
        }
    }
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
    ids: Ids,
    head: Head,
    sequence: u64,
    open: Option<Open>,
    /// Output items closed so far (their index is their position).
    items: Vec<Item>,
    /// The text of the open reasoning or message item so far.
    text: String,
    /// The tool call being streamed, if one is.
    calling: Option<Calling>,
}

/// The call whose output item is open in a stream.
struct Calling {
    item_id: String,
    index: usize,
    custom: bool,
    /// The arguments streamed so far.
    arguments: String,
}

impl EventStream {
    fn event(&mut self, event: Event) -> SseEvent {
        let sequence_number = self.sequence;
        self.sequence += 1;
        let data = serde_json::to_value(Sequenced { event: &event, sequence_number }).unwrap_or(Value::Null);
        let name = data["type"].as_str().unwrap_or("error").to_string();
        SseEvent::default().event(name).data(data.to_string())
    }

    fn index(&self) -> usize {
        self.items.len()
    }

    fn of(&mut self, step: Step) -> Vec<SseEvent> {
        match step {
            Step::Prefilled(_) => vec![],
            Step::Reasoning(delta) => {
                let mut out = self.open(Open::Reasoning);
                self.text.push_str(&delta);
                let (item_id, output_index) = (self.ids.reasoning(), self.index());
                out.push(self.event(Event::ReasoningSummaryTextDelta {
                    item_id,
                    output_index,
                    summary_index: 0,
                    delta,
                }));
                out
            }
            Step::Text(delta) => {
                let mut out = self.open(Open::Message);
                self.text.push_str(&delta);
                let (item_id, output_index) = (self.ids.message(), self.index());
                out.push(self.event(Event::OutputTextDelta { item_id, output_index, content_index: 0, delta }));
                out
            }
            Step::CallBegin { index, name } => self.open_call(index, &ParsedCall { name, arguments: Value::Null }),
            // A custom tool's input is inside the arguments' JSON: it is sent whole at the end.
            Step::CallArguments { fragment, .. } => match &mut self.calling {
                Some(c) if !c.custom => {
                    c.arguments.push_str(&fragment);
                    let (item_id, output_index) = (c.item_id.clone(), c.index);
                    vec![self.event(Event::FunctionCallArgumentsDelta { item_id, output_index, delta: fragment })]
                }
                _ => vec![],
            },
            Step::CallEnd { index, call, streamed } => {
                let mut out = if streamed { vec![] } else { self.open_call(index, &call) };
                out.extend(self.close_call(index, &call));
                out
            }
            Step::Finished(answer) => {
                let mut out = Vec::new();
                if self.items.is_empty() && self.open.is_none() {
                    out.extend(self.open(Open::Message)); // an answer with nothing in it
                }
                out.extend(self.close_item());
                let response = self.head.response(&self.ids, Some(&answer), self.items.clone());
                out.push(self.event(match response.status {
                    "incomplete" => Event::Incomplete { response },
                    _ => Event::Completed { response },
                }));
                out
            }
            Step::Failed(e) => vec![self.event(Event::Error { message: e.message })],
        }
    }

    fn open(&mut self, kind: Open) -> Vec<SseEvent> {
        if self.open == Some(kind) {
            return vec![];
        }
        let mut out = self.close_item();
        self.open = Some(kind);
        let output_index = self.index();
        match kind {
            Open::Reasoning => {
                let item = Item::Reasoning { id: self.ids.reasoning(), summary: vec![] };
                out.push(self.event(Event::OutputItemAdded { output_index, item }));
                let part = SummaryText::new("");
                let item_id = self.ids.reasoning();
                out.push(self.event(Event::ReasoningSummaryPartAdded {
                    item_id,
                    output_index,
                    summary_index: 0,
                    part,
                }));
            }
            Open::Message => {
                let item = self.ids.message_item(None);
                out.push(self.event(Event::OutputItemAdded { output_index, item }));
                let (item_id, part) = (self.ids.message(), OutputText::new(""));
                out.push(self.event(Event::ContentPartAdded { item_id, output_index, content_index: 0, part }));
            }
        }
        out
    }

    /// Closes the open reasoning or message item with its whole text.
    fn close_item(&mut self) -> Vec<SseEvent> {
        let Some(kind) = self.open.take() else { return vec![] };
        let (output_index, text) = (self.index(), std::mem::take(&mut self.text));
        let mut out = Vec::new();
        let item = match kind {
            Open::Reasoning => {
                let item_id = self.ids.reasoning();
                let done = Event::ReasoningSummaryTextDone {
                    item_id: item_id.clone(),
                    output_index,
                    summary_index: 0,
                    text: text.clone(),
                };
                out.push(self.event(done));
                let part = SummaryText::new(&text);
                out.push(self.event(Event::ReasoningSummaryPartDone { item_id, output_index, summary_index: 0, part }));
                self.ids.reasoning_item(&text)
            }
            Open::Message => {
                let item_id = self.ids.message();
                let done = Event::OutputTextDone {
                    item_id: item_id.clone(),
                    output_index,
                    content_index: 0,
                    text: text.clone(),
                };
                out.push(self.event(done));
                let part = OutputText::new(&text);
                out.push(self.event(Event::ContentPartDone { item_id, output_index, content_index: 0, part }));
                self.ids.message_item(Some(&text))
            }
        };
        out.push(self.event(Event::OutputItemDone { output_index, item: item.clone() }));
        self.items.push(item);
        out
    }

    /// Opens call `n`'s output item (a `function_call`, or a `custom_tool_call`).
    fn open_call(&mut self, n: usize, call: &ParsedCall) -> Vec<SseEvent> {
        let mut out = self.close_item();
        let (output_index, custom) = (self.index(), self.ids.is_custom(call));
        let item = self.ids.call_item(n, call, false);
        out.push(self.event(Event::OutputItemAdded { output_index, item }));
        let item_id = self.ids.call(n, custom);
        self.calling = Some(Calling { item_id, index: output_index, custom, arguments: String::new() });
        out
    }

    /// Closes the open call's item: its whole arguments (as streamed) or custom input.
    fn close_call(&mut self, n: usize, call: &ParsedCall) -> Vec<SseEvent> {
        let Some(c) = self.calling.take() else { return vec![] };
        let (item_id, output_index) = (c.item_id.clone(), c.index);
        let mut out = Vec::new();
        let mut item = self.ids.call_item(n, call, true);
        if c.custom {
            let input = custom_input(&call.arguments);
            let delta =
                Event::CustomToolCallInputDelta { item_id: item_id.clone(), output_index, delta: input.clone() };
            out.push(self.event(delta));
            out.push(self.event(Event::CustomToolCallInputDone { item_id, output_index, input }));
        } else {
            // The arguments as streamed (a call that was not streamed sends them whole now).
            let arguments = if c.arguments.is_empty() {
                let whole = call.arguments.to_string();
                let delta =
                    Event::FunctionCallArgumentsDelta { item_id: item_id.clone(), output_index, delta: whole.clone() };
                out.push(self.event(delta));
                whole
            } else {
                c.arguments
            };
            if let Item::FunctionCall { arguments: a, .. } = &mut item {
                *a = arguments.clone();
            }
            out.push(self.event(Event::FunctionCallArgumentsDone { item_id, output_index, arguments }));
        }
        out.push(self.event(Event::OutputItemDone { output_index, item: item.clone() }));
        self.items.push(item);
        out
    }
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
                if let Err(e) = ToolChoice::responses(req.tool_choice.as_ref(), None).and_then(|c| prompt(&req, &c, &mut Images::new(true))) {
                    prop_assert!(e.status.is_client_error(), "{}", e.message);
                }
            }
        }
    }
}

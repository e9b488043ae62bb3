//! The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::{GenerateRequest, SamplingParams};
use futures_util::stream::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;

use crate::answer::{self, Answer, Finish, Settings, Step, TemplateTool};
use crate::error::{parse, ApiError};
use crate::job::Prompt;
use crate::response_format::{Expect, ResponseFormat};
use crate::tool_choice::{self, ToolChoice};
use crate::tools::ParsedCall;

use crate::images::{ImageUrl, Images};
use crate::{AppState, Loaded};

/// Message content as OpenAI's APIs send it: a string, or typed parts (also the Responses API's).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) text: Option<String>,
    /// `image_url` parts: `{"url": ...}` (the Responses API's `input_image`: the URL itself).
    #[serde(default)]
    pub(crate) image_url: Option<ImageUrl>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Vec<InCall>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// A tool call of an earlier assistant turn, as the client sends it back.
#[derive(Debug, Deserialize)]
struct InCall {
    function: InFunction,
}

#[derive(Debug, Deserialize)]
struct InFunction {
    name: String,
    /// A JSON document in a string, as OpenAI sends it.
    #[serde(default)]
    arguments: String,
}

#[derive(Debug, Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    function: ToolFunction,
}

#[derive(Debug, Deserialize)]
struct ToolFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields shared by chat and text completions.
#[derive(Debug, Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Extension (as vLLM has it): keep generating past end-of-sequence, for benchmarks.
    #[serde(default)]
    ignore_eos: bool,
    /// OpenAI's penalties, and the repetition penalty of mlx-lm's and vLLM's servers, applied
    /// as mlx-lm applies them (over the last 20 tokens); see `engine::penalties`.
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    /// OpenAI's `logit_bias`: token id (as a string) → a bias in [-100, 100] added to its logit.
    #[serde(default)]
    logit_bias: Option<BTreeMap<String, f32>>,
    /// Choices per request: only 1 is served, and anything else is refused rather than ignored.
    #[serde(default)]
    n: Option<u32>,
    /// Log-probabilities are not served: asking for them is refused rather than ignored
    /// (`true` or a count for chat, a count for text completions).
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<u32>,
}

/// Chat-only fields (read from the same body as [`Common`]: serde's `flatten` would lose the
/// path of a wrong field).
#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Vec<Tool>,
    /// `none` hides the tools; `auto` offers them; `required` or a named function holds the
    /// answer to calls (`tool_choice.rs`).
    #[serde(default)]
    tool_choice: Option<Value>,
    /// With `required`: `false` holds the answer to one call.
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    response_format: Option<ResponseFormat>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: String,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// OpenAI's finish reason: tool calls first, then why the text ended.
fn finish_reason(answer: &Answer) -> &'static str {
    match answer.finish {
        _ if !answer.calls.is_empty() => "tool_calls",
        Finish::OutOfTokens(_) => "length",
        Finish::GrammarDeadEnd => "grammar_dead_end",
        Finish::EndOfTurn | Finish::StopSequence => "stop",
    }
}

impl Common {
    /// The request for the engine, and the model that will run it.
    fn generate_request(&self, state: &AppState) -> Result<(GenerateRequest, Arc<Loaded>), ApiError> {
        let loaded = state.resolve_model(&self.model)?;
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(
                "n: Ferrite returns one choice per request; send several requests for more",
            )
            .with_param("n"));
        }
        let wants_logprobs = match &self.logprobs {
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_u64() != Some(0),
            _ => false,
        };
        if wants_logprobs || self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(
                ApiError::bad_request("logprobs: Ferrite does not return log-probabilities").with_param("logprobs")
            );
        }
        let settings = Settings {
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            max_tokens_field: if self.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" },
            stop: match &self.stop {
                None => vec![],
                Some(Stop::One(s)) => vec![s.clone()],
                Some(Stop::Many(v)) => v.clone(),
            },
            stop_field: "stop",
            sampling: SamplingParams {
                temperature: self.temperature.unwrap_or(0.0),
                top_p: self.top_p.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
                min_p: self.min_p.unwrap_or(0.0),
                seed: self.seed,
                penalties: engine::Penalties {
                    repetition: self.repetition_penalty.unwrap_or(1.0),
                    presence: self.presence_penalty.unwrap_or(0.0),
                    frequency: self.frequency_penalty.unwrap_or(0.0),
                },
                logit_bias: logit_bias(self.logit_bias.as_ref())?,
            },
            ignore_eos: self.ignore_eos,
        };
        let request = settings.request(&loaded)?;
        Ok((request, loaded))
    }
}

/// OpenAI's `logit_bias` map as (token id, bias) pairs; a key that is not a token id is
/// refused by name (the engine checks the ids against the vocabulary and the biases' range).
fn logit_bias(map: Option<&BTreeMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = map else { return Ok(Vec::new()) };
    map.iter()
        .map(|(key, &bias)| match key.trim().parse::<u32>() {
            Ok(id) => Ok((id, bias)),
            Err(_) => {
                Err(ApiError::bad_request(format!("logit_bias: `{key}` is not a token id")).with_param("logit_bias"))
            }
        })
        .collect()
}

fn chat_prompt(req: &ChatRequest, choice: &ToolChoice, images: &mut Images) -> Result<Prompt, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").with_param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(
                ApiError::bad_request(format!("messages[{i}].role: unknown role `{}`", m.role)).with_param("messages")
            );
        }
        let (content, at) = match &m.content {
            None => (String::new(), vec![]),
            Some(Content::Text(t)) => (t.clone(), vec![]),
            Some(Content::Parts(parts)) => text_and_images(parts, images, &format!("messages[{i}].content"))?,
        };
        let role = if m.role == "developer" { "system" } else { m.role.as_str() };
        let mut message = ChatMessage::new(role, &content);
        message.images = at;
        message.tool_call_id = m.tool_call_id.clone();
        for call in &m.tool_calls {
            let args = serde_json::from_str(&call.function.arguments)
                .unwrap_or_else(|_| Value::String(call.function.arguments.clone()));
            message.tool_calls.push(ToolCall::new(&call.function.name, args));
        }
        messages.push(message);
    }
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    let offer_tools = !req.tools.is_empty() && *choice != ToolChoice::None;
    if offer_tools {
        let mut tools = Vec::new();
        for (i, t) in req.tools.iter().enumerate() {
            if t.kind != "function" || t.function.name.is_empty() {
                return Err(ApiError::bad_request(format!("tools[{i}]: only named functions are supported"))
                    .with_param("tools"));
            }
            let f = &t.function;
            tools.push(TemplateTool::function(&f.name, f.description.clone(), f.parameters.clone()));
        }
        vars.insert("tools".into(), TemplateTool::variable(&tools));
    }
    if req.reasoning_effort.as_deref() == Some("none") {
        vars.insert("enable_thinking".into(), false.into());
    }
    Ok(Prompt::Chat { messages, template_vars: vars, loaded_tools: vec![] })
}

/// A message's text parts joined, and where its `image_url` parts sit in that text.
pub(crate) fn text_and_images(
    parts: &[Part],
    images: &mut Images,
    path: &str,
) -> Result<(String, Vec<usize>), ApiError> {
    let each = parts.iter().map(|p| (p.kind.as_str(), p.text.as_deref(), p.image_url.as_ref().map(ImageUrl::url)));
    crate::images::text_and_images(each, images, path)
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let common: Common = parse(&body)?;
    let req: ChatRequest = parse(&body)?;
    let (mut request, loaded) = common.generate_request(&state)?;
    let choice = ToolChoice::openai(req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let mut images = Images::new(loaded.worker.info.sees);
    let prompt = chat_prompt(&req, &choice, &mut images)?;
    request.images = images.into_list();
    let mut expect = match &req.response_format {
        Some(format) => format.expectation()?,
        None => None,
    };
    request.grammar = expect.as_ref().map(Expect::grammar);
    if let Some(grammar) = req.response_format.as_ref().map(ResponseFormat::custom_grammar).transpose()?.flatten() {
        request.grammar = Some(grammar);
    }
    // A forced call's grammar holds the answer; no content is left to check against a format.
    if let Some(calls) = choice.grammar(&tool_choice::offered(&prompt), loaded.worker.info.call_syntax)? {
        request.grammar = Some(calls);
        expect = None;
    }
    respond(state, loaded, prompt, request, &common, Kind::Chat, expect).await
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let common: Common = parse(&body)?;
    let req: CompletionRequest = parse(&body)?;
    let (request, loaded) = common.generate_request(&state)?;
    respond(state, loaded, Prompt::Text(req.prompt), request, &common, Kind::Text, None).await
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

/// Runs the request and answers it, whole or as server-sent events. With a `response_format`,
/// the answer's check goes beside it (`response_format_check`, and a header when not streaming).
#[allow(clippy::too_many_arguments)]
async fn respond(
    state: AppState,
    loaded: Arc<Loaded>,
    prompt: Prompt,
    request: GenerateRequest,
    common: &Common,
    kind: Kind,
    expect: Option<Expect>,
) -> Result<Response, ApiError> {
    let (running, mut headers) = answer::run(&state, &loaded, prompt, request).await?;
    let head = Head {
        id: format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, state.next_id()),
        call_base: format!("call_{}", state.next_id()),
        model: loaded.worker.info.id.clone(),
        created: now(),
        kind,
    };

    if !common.stream {
        let answer = answer::collect(running).await?;
        let check = expect.map(|e| e.report(&answer.text));
        if let Some(check) = &check {
            let valid = check["valid"] == Value::Bool(true);
            let verdict = HeaderValue::from_static(if valid { "valid" } else { "invalid" });
            headers.insert("x-ferrite-response-format", verdict);
        }
        let body = match kind {
            Kind::Chat => serde_json::to_value(head.chat_completion(&answer, check)),
            Kind::Text => serde_json::to_value(head.text_completion(&answer)),
        };
        let body = body.map_err(|e| ApiError::internal(e.to_string()))?;
        return Ok((headers, Json(body)).into_response());
    }

    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let mut chunks = Chunks { head, include_usage, expect };
    let first = chunks
        .head
        .chunk(ChunkDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() }, None);
    let stream = futures_util::stream::once(async move { first })
        .chain(answer::steps(running).flat_map(move |step| futures_util::stream::iter(chunks.of(step))))
        .map(|chunk| Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string())))
        .chain(futures_util::stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    Ok((headers, Sse::new(stream).keep_alive(KeepAlive::default())).into_response())
}

/// What every object of one answer repeats.
struct Head {
    id: String,
    /// Before each tool call's index: `call_<a fresh id>-<index>`.
    call_base: String,
    model: String,
    created: u64,
    kind: Kind,
}

impl Head {
    fn chat_completion(&self, answer: &Answer, check: Option<Value>) -> ChatCompletion {
        let calls: Vec<OutCall> =
            answer.calls.iter().enumerate().map(|(i, c)| OutCall::whole(&self.call_base, i, c)).collect();
        let content = (!answer.text.is_empty() || calls.is_empty()).then(|| answer.text.clone());
        let message = AssistantMessage {
            role: "assistant",
            content,
            reasoning_content: (!answer.reasoning.is_empty()).then(|| answer.reasoning.clone()),
            tool_calls: calls,
        };
        ChatCompletion {
            id: self.id.clone(),
            object: "chat.completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChatChoice { index: 0, message, finish_reason: finish_reason(answer) }],
            usage: Usage::of(answer),
            timings: Timings::of(&answer.summary),
            response_format_check: check,
        }
    }

    fn text_completion(&self, answer: &Answer) -> TextCompletion {
        let text = format!("{}{}", answer.reasoning, answer.text);
        TextCompletion {
            choices: vec![TextChoice { index: 0, text, finish_reason: Some(finish_reason(answer)) }],
            usage: Some(Usage::of(answer)),
            timings: Some(Timings::of(&answer.summary)),
            ..self.text_chunk(String::new(), None)
        }
    }

    fn text_chunk(&self, text: String, finish_reason: Option<&'static str>) -> TextCompletion {
        TextCompletion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![TextChoice { index: 0, text, finish_reason }],
            usage: None,
            timings: None,
        }
    }

    /// One streamed chunk (chat, or the text of a text completion).
    fn chunk(&self, delta: ChunkDelta, finish_reason: Option<&'static str>) -> Value {
        let chunk = match self.kind {
            Kind::Chat => serde_json::to_value(ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChunkChoice { index: 0, delta, finish_reason }],
                usage: None,
                timings: None,
                response_format_check: None,
            }),
            Kind::Text => {
                let text =
                    format!("{}{}", delta.reasoning_content.unwrap_or_default(), delta.content.unwrap_or_default());
                serde_json::to_value(self.text_chunk(text, finish_reason))
            }
        };
        chunk.unwrap_or(Value::Null)
    }
}

/// A stream's state: the chunks each step becomes.
struct Chunks {
    head: Head,
    include_usage: bool,
    /// The response format the finished text is checked against, if one was asked for.
    expect: Option<Expect>,
}

impl Chunks {
    fn of(&mut self, step: Step) -> Vec<Value> {
        let delta = |d: ChunkDelta| vec![self.head.chunk(d, None)];
        let call = |c: ChunkCall| vec![self.head.chunk(ChunkDelta { tool_calls: vec![c], ..Default::default() }, None)];
        match step {
            Step::Prefilled(_) => vec![],
            Step::Text(t) => delta(ChunkDelta { content: Some(t), ..Default::default() }),
            Step::Reasoning(r) => delta(ChunkDelta { reasoning_content: Some(r), ..Default::default() }),
            // A call streams as it is written: its id and name, then its arguments in fragments.
            Step::CallBegin { index, name } => call(ChunkCall {
                index,
                id: Some(format!("{}-{index}", self.head.call_base)),
                kind: Some("function"),
                function: ChunkFunction { name: Some(name), arguments: String::new() },
            }),
            Step::CallArguments { index, fragment } => call(ChunkCall {
                index,
                id: None,
                kind: None,
                function: ChunkFunction { name: None, arguments: fragment },
            }),
            Step::CallEnd { streamed: true, .. } => vec![],
            Step::CallEnd { index, call: c, streamed: false } => {
                let whole = OutCall::whole(&self.head.call_base, index, &c);
                call(ChunkCall {
                    index,
                    id: Some(whole.id),
                    kind: Some("function"),
                    function: ChunkFunction { name: Some(whole.function.name), arguments: whole.function.arguments },
                })
            }
            Step::Finished(answer) => self.last(&answer),
            Step::Failed(e) => {
                let error = StreamError { error: ErrorBody { message: e.message, kind: "server_error" } };
                vec![serde_json::to_value(error).unwrap_or(Value::Null)]
            }
        }
    }

    /// The finish chunk (with the engine's timings and any format check), then the usage
    /// chunk (no choices) when the client asked for one.
    fn last(&self, answer: &Answer) -> Vec<Value> {
        let (reason, timings, usage) = (Some(finish_reason(answer)), Timings::of(&answer.summary), Usage::of(answer));
        let usage = self.include_usage.then_some(usage);
        let out = match self.head.kind {
            Kind::Text => {
                let mut last = self.head.text_chunk(String::new(), reason);
                last.timings = Some(timings);
                let usage = usage.map(|u| TextCompletion {
                    choices: vec![],
                    usage: Some(u),
                    ..self.head.text_chunk(String::new(), None)
                });
                [serde_json::to_value(last)].into_iter().chain(usage.map(serde_json::to_value)).collect::<Vec<_>>()
            }
            Kind::Chat => {
                let chunk = |choices, usage, timings, check| ChatChunk {
                    id: self.head.id.clone(),
                    object: "chat.completion.chunk",
                    created: self.head.created,
                    model: self.head.model.clone(),
                    choices,
                    usage,
                    timings,
                    response_format_check: check,
                };
                let finish = vec![ChunkChoice { index: 0, delta: ChunkDelta::default(), finish_reason: reason }];
                let check = self.expect.as_ref().map(|e| e.report(&answer.text));
                let last = chunk(finish, None, Some(timings), check);
                let usage = usage.map(|u| chunk(vec![], Some(u), None, None));
                [serde_json::to_value(last)].into_iter().chain(usage.map(serde_json::to_value)).collect()
            }
        };
        out.into_iter().map(|v| v.unwrap_or(Value::Null)).collect()
    }
}

#[derive(Serialize)]
struct ChatCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<ChatChoice>,
    usage: Usage,
    timings: Timings,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format_check: Option<Value>,
}

#[derive(Serialize)]
struct ChatChoice {
    index: u32,
    message: AssistantMessage,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct AssistantMessage {
    role: &'static str,
    /// `null` when the turn is only tool calls.
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<OutCall>,
}

/// A tool call in OpenAI's response shape (arguments as a JSON string).
#[derive(Serialize)]
struct OutCall {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: OutFunction,
}

#[derive(Serialize)]
struct OutFunction {
    name: String,
    arguments: String,
}

impl OutCall {
    fn whole(base: &str, i: usize, c: &ParsedCall) -> Self {
        OutCall {
            id: format!("{base}-{i}"),
            kind: "function",
            function: OutFunction { name: c.name.clone(), arguments: c.arguments.to_string() },
        }
    }
}

#[derive(Serialize)]
struct TextCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<TextChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timings: Option<Timings>,
}

#[derive(Serialize)]
struct TextChoice {
    index: u32,
    text: String,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatChunk {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timings: Option<Timings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format_check: Option<Value>,
}

#[derive(Serialize)]
struct ChunkChoice {
    index: u32,
    delta: ChunkDelta,
    finish_reason: Option<&'static str>,
}

#[derive(Default, Serialize)]
struct ChunkDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ChunkCall>,
}

/// A streamed call: its first chunk has the id, type and name; the rest, argument fragments.
#[derive(Serialize)]
struct ChunkCall {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: ChunkFunction,
}

#[derive(Serialize)]
struct ChunkFunction {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    arguments: String,
}

#[derive(Serialize)]
struct StreamError {
    error: ErrorBody,
}

#[derive(Serialize)]
struct ErrorBody {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
    prompt_tokens_details: PromptDetails,
    completion_tokens_details: CompletionDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: usize,
}

#[derive(Serialize)]
struct CompletionDetails {
    reasoning_tokens: usize,
}

impl Usage {
    fn of(answer: &Answer) -> Self {
        let u = &answer.summary.usage;
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptDetails { cached_tokens: u.cached_tokens },
            completion_tokens_details: CompletionDetails { reasoning_tokens: answer.reasoning_tokens },
        }
    }
}

/// The engine's own figures for the request, so a client can compare what it saw at the
/// HTTP boundary with what the engine did (an extension field; SDKs ignore it).
#[derive(Serialize)]
struct Timings {
    ttft_ms: f64,
    prompt_tps: f64,
    decode_tps: f64,
    peak_memory_bytes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_depth: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    acceptance: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_per_cycle: Option<f64>,
    /// The runtime depth controller's state at the end (the depth it ran at last, what it
    /// expected and measured over plain decoding, its changes).
    #[serde(skip_serializing_if = "Option::is_none")]
    depth_control: Option<engine::speculative::ControlStats>,
}

impl Timings {
    fn of(summary: &engine::Summary) -> Self {
        let t = &summary.timings;
        let spec = summary.speculative.as_ref();
        Timings {
            ttft_ms: t.ttft.as_secs_f64() * 1e3,
            prompt_tps: t.prompt_tps,
            decode_tps: t.decode_tps,
            peak_memory_bytes: t.peak_memory_bytes,
            draft_depth: spec.map(|s| s.depth),
            acceptance: spec.map(|s| s.acceptance()),
            tokens_per_cycle: spec.map(|s| s.tokens_per_cycle()),
            depth_control: spec.and_then(|s| s.control.as_deref().cloned()),
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any body: parsed or refused with a 4xx naming what was wrong; never a panic.
        #[test]
        fn chat_bodies_never_panic(body in crate::fuzz::body()) {
            let body = Bytes::from(body);
            if let (Ok(_common), Ok(req)) = (parse::<Common>(&body), parse::<ChatRequest>(&body)) {
                match ToolChoice::openai(req.tool_choice.as_ref(), req.parallel_tool_calls) {
                    Ok(choice) => match chat_prompt(&req, &choice, &mut crate::images::Images::new(true)) {
                        Ok(prompt) => {
                            if let Err(e) = choice.grammar(&tool_choice::offered(&prompt), crate::tool_choice::CallSyntax { form: crate::tool_choice::CallForm::Xml, tags_are_tokens: true }) {
                                prop_assert!(e.status.is_client_error(), "{}", e.message);
                            }
                        }
                        Err(e) => prop_assert!(e.status.is_client_error(), "{}", e.message),
                    },
                    Err(e) => prop_assert!(e.status.is_client_error(), "{}", e.message),
                }
                if let Some(format) = &req.response_format {
                    let _ = format.expectation();
                }
            }
            let _ = parse::<CompletionRequest>(&body);
        }
    }
}

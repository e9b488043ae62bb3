//! The Responses API's output as the wire carries it: the response object, its items, usage,
//! and the stream's events.

use serde::Serialize;
use serde_json::Value;

use crate::answer::Answer;

/// The response object (also the payload of `response.created` and `response.completed`).
#[derive(Serialize)]
pub(crate) struct ResponseObject {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created_at: u64,
    pub(crate) status: &'static str,
    pub(crate) model: String,
    pub(crate) output: Vec<Item>,
    pub(crate) usage: Option<Usage>,
    pub(crate) incomplete_details: Option<Incomplete>,
    pub(crate) error: Option<String>,
    pub(crate) parallel_tool_calls: bool,
    /// Always false: Ferrite keeps no responses, whatever the request's `store` said.
    pub(crate) store: bool,
    pub(crate) tool_choice: &'static str,
    pub(crate) tools: Vec<Value>,
}

#[derive(Serialize)]
pub(crate) struct Incomplete {
    pub(crate) reason: &'static str,
}

/// An output item.
#[derive(Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Item {
    Reasoning { id: String, summary: Vec<SummaryText> },
    Message { id: String, status: &'static str, role: &'static str, content: Vec<OutputText> },
    FunctionCall { id: String, call_id: String, name: String, arguments: String, status: &'static str },
    CustomToolCall { id: String, call_id: String, name: String, input: String, status: &'static str },
}

#[derive(Clone, Serialize)]
pub(crate) struct SummaryText {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) text: String,
}

impl SummaryText {
    pub(crate) fn new(text: &str) -> Self {
        SummaryText { kind: "summary_text", text: text.to_string() }
    }
}

#[derive(Clone, Serialize)]
pub(crate) struct OutputText {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) text: String,
    pub(crate) annotations: Vec<Value>,
}

impl OutputText {
    pub(crate) fn new(text: &str) -> Self {
        OutputText { kind: "output_text", text: text.to_string(), annotations: vec![] }
    }
}

#[derive(Serialize)]
pub(crate) struct Usage {
    pub(crate) input_tokens: usize,
    pub(crate) input_tokens_details: InputDetails,
    pub(crate) output_tokens: usize,
    pub(crate) output_tokens_details: OutputDetails,
    pub(crate) total_tokens: usize,
}

#[derive(Serialize)]
pub(crate) struct InputDetails {
    pub(crate) cached_tokens: usize,
}

#[derive(Serialize)]
pub(crate) struct OutputDetails {
    pub(crate) reasoning_tokens: usize,
}

impl Usage {
    pub(crate) fn of(answer: &Answer) -> Self {
        let u = &answer.summary.usage;
        Usage {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputDetails { cached_tokens: u.cached_tokens },
            output_tokens: u.completion_tokens,
            output_tokens_details: OutputDetails { reasoning_tokens: answer.reasoning_tokens },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// A streamed event and its place in the stream.
#[derive(Serialize)]
pub(crate) struct Sequenced<'a> {
    #[serde(flatten)]
    pub(crate) event: &'a Event,
    pub(crate) sequence_number: u64,
}

/// The Responses stream's events; the SSE event's name is the payload's `type`.
#[derive(Serialize)]
#[serde(tag = "type")]
pub(crate) enum Event {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { output_index: usize, item: Item },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { output_index: usize, item: Item },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded { item_id: String, output_index: usize, content_index: usize, part: OutputText },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone { item_id: String, output_index: usize, content_index: usize, part: OutputText },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta { item_id: String, output_index: usize, content_index: usize, delta: String },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone { item_id: String, output_index: usize, content_index: usize, text: String },
    #[serde(rename = "response.reasoning_summary_part.added")]
    ReasoningSummaryPartAdded { item_id: String, output_index: usize, summary_index: usize, part: SummaryText },
    #[serde(rename = "response.reasoning_summary_part.done")]
    ReasoningSummaryPartDone { item_id: String, output_index: usize, summary_index: usize, part: SummaryText },
    #[serde(rename = "response.reasoning_summary_text.delta")]
    ReasoningSummaryTextDelta { item_id: String, output_index: usize, summary_index: usize, delta: String },
    #[serde(rename = "response.reasoning_summary_text.done")]
    ReasoningSummaryTextDone { item_id: String, output_index: usize, summary_index: usize, text: String },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta { item_id: String, output_index: usize, delta: String },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone { item_id: String, output_index: usize, arguments: String },
    #[serde(rename = "response.custom_tool_call_input.delta")]
    CustomToolCallInputDelta { item_id: String, output_index: usize, delta: String },
    #[serde(rename = "response.custom_tool_call_input.done")]
    CustomToolCallInputDone { item_id: String, output_index: usize, input: String },
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject },
    #[serde(rename = "error")]
    Error { message: String },
}

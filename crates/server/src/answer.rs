//! The answer layer the three APIs share: a request's generation settings checked once, the
//! tools offered in the chat template's form, and the engine's job events turned into one
//! protocol-neutral sequence of [`Step`]s (text, reasoning, tool calls begun, argument
//! fragments and ends, then the whole [`Answer`]). `openai.rs`, `responses.rs` and
//! `anthropic.rs` only convert their typed requests into a prompt and these steps into their
//! typed responses and events.

use axum::http::HeaderMap;
use engine::{FinishReason, GenerateRequest, SamplingParams, Summary};
use futures_util::stream::{Stream, StreamExt};
use serde::Serialize;
use serde_json::Value;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::job::{Clamp, ClampedBy, JobEvent, Prompt, Running};
use crate::tools::{CallEvent, ParsedCall};
use crate::{AppState, Loaded};

/// What a request asks of the generation, with the names its protocol gives the fields (an
/// error names the field the client sent).
pub struct Settings {
    /// None: the client set no limit, and the server chooses one ([`crate::job::NOT_ASKED`]).
    pub max_tokens: Option<usize>,
    pub max_tokens_field: &'static str,
    pub stop: Vec<String>,
    pub stop_field: &'static str,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
}

impl Settings {
    /// The engine's request for `loaded`, or a 400 naming the field that was wrong.
    pub fn request(self, loaded: &Loaded) -> Result<GenerateRequest, ApiError> {
        if self.max_tokens == Some(0) {
            let field = self.max_tokens_field;
            return Err(ApiError::bad_request(format!("{field}: must be at least 1")).with_param(field));
        }
        if self.stop.iter().any(String::is_empty) {
            let field = self.stop_field;
            return Err(ApiError::bad_request(format!("{field}: must not contain empty strings")).with_param(field));
        }
        self.sampling.validate().map_err(engine_error)?;
        self.sampling.check_vocabulary(loaded.worker.info.vocab_size).map_err(engine_error)?;
        Ok(GenerateRequest {
            sampling: self.sampling,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            ..GenerateRequest::greedy(vec![], self.max_tokens.unwrap_or(crate::job::NOT_ASKED))
        })
    }
}

/// An engine error about the request: a 400, with the field when the engine names one.
fn engine_error(e: engine::Error) -> ApiError {
    let field = match &e {
        engine::Error::Field { field, .. } => Some(*field),
        _ => None,
    };
    let error = ApiError::bad_request(e.to_string());
    match field {
        Some(f) => error.with_param(f),
        None => error,
    }
}

/// A tool as chat templates read it (`tools` in the template's variables).
#[derive(Debug, Clone, Serialize)]
pub struct TemplateTool {
    #[serde(rename = "type")]
    kind: &'static str,
    function: TemplateFunction,
}

#[derive(Debug, Clone, Serialize)]
struct TemplateFunction {
    name: String,
    description: Option<String>,
    parameters: Value,
}

impl TemplateTool {
    /// A function tool; without a schema, one that takes no arguments.
    pub fn function(name: &str, description: Option<String>, parameters: Option<Value>) -> Self {
        let parameters = parameters.unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        TemplateTool {
            kind: "function",
            function: TemplateFunction { name: name.to_string(), description, parameters },
        }
    }

    /// The template variable holding `tools`.
    pub fn variable(tools: &[TemplateTool]) -> Value {
        serde_json::to_value(tools).unwrap_or(Value::Null)
    }
}

/// Why an answer ended, before any protocol names it. A turn that made tool calls ended to
/// let the client run them, whatever stopped the text ([`Answer::calls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its turn (end-of-sequence), or it was cancelled.
    EndOfTurn,
    /// One of the request's stop strings.
    StopSequence,
    /// Out of tokens: the request's own limit (`None`), or a limit the server set.
    OutOfTokens(Option<ClampedBy>),
    /// The request's grammar allowed no token of the vocabulary next: the answer is what the
    /// grammar let through so far. Every API names it `grammar_dead_end`.
    GrammarDeadEnd,
}

impl Finish {
    fn of(summary: &Summary, clamped: Option<Clamp>) -> Finish {
        match (summary.finish_reason, &summary.stop_string) {
            (FinishReason::Length, _) => Finish::OutOfTokens(clamped.map(|c| c.by)),
            (FinishReason::GrammarDeadEnd, _) => Finish::GrammarDeadEnd,
            (_, Some(_)) => Finish::StopSequence,
            _ => Finish::EndOfTurn,
        }
    }
}

/// The whole answer: what every protocol's final object (or final event) is made of.
#[derive(Debug, Clone)]
pub struct Answer {
    pub text: String,
    pub reasoning: String,
    pub calls: Vec<ParsedCall>,
    pub finish: Finish,
    pub summary: Summary,
    pub reasoning_tokens: usize,
}

/// What a streamed answer learns, in order.
#[derive(Debug, Clone)]
pub enum Step {
    /// How many prompt tokens the prompt cache restored (before the first delta).
    Prefilled(usize),
    Reasoning(String),
    Text(String),
    /// Call number `index` began: its tool's name. Its arguments follow in fragments.
    CallBegin {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments (the fragments joined are its JSON document).
    CallArguments {
        index: usize,
        fragment: String,
    },
    /// Call `index` is complete. `streamed`: its begin and fragments came before; otherwise
    /// this is the whole call, seen for the first time.
    CallEnd {
        index: usize,
        call: ParsedCall,
        streamed: bool,
    },
    Finished(Box<Answer>),
    Failed(ApiError),
}

/// Turns job events into steps, keeping the answer so far.
pub struct Steps {
    clamped: Option<Clamp>,
    text: String,
    reasoning: String,
    calls: Vec<ParsedCall>,
    call_open: bool,
}

impl Steps {
    pub fn new(clamped: Option<Clamp>) -> Self {
        Steps { clamped, text: String::new(), reasoning: String::new(), calls: Vec::new(), call_open: false }
    }

    pub fn next(&mut self, event: JobEvent) -> Vec<Step> {
        match event {
            JobEvent::Started { .. } => vec![],
            JobEvent::Prefilled { cached_tokens } => vec![Step::Prefilled(cached_tokens)],
            JobEvent::Delta { content, reasoning, tool_calls } => {
                let mut out = Vec::new();
                if !reasoning.is_empty() {
                    self.reasoning.push_str(&reasoning);
                    out.push(Step::Reasoning(reasoning));
                }
                if !content.is_empty() {
                    self.text.push_str(&content);
                    out.push(Step::Text(content));
                }
                for event in tool_calls {
                    let index = self.calls.len();
                    out.push(match event {
                        CallEvent::Begin { name } => {
                            self.call_open = true;
                            Step::CallBegin { index, name }
                        }
                        CallEvent::Arguments(fragment) => Step::CallArguments { index, fragment },
                        CallEvent::End(call) => {
                            let streamed = std::mem::take(&mut self.call_open);
                            self.calls.push(call.clone());
                            Step::CallEnd { index, call, streamed }
                        }
                    });
                }
                out
            }
            JobEvent::Finished { summary, reasoning_tokens } => {
                let answer = Answer {
                    text: std::mem::take(&mut self.text),
                    reasoning: std::mem::take(&mut self.reasoning),
                    calls: std::mem::take(&mut self.calls),
                    finish: Finish::of(&summary, self.clamped),
                    summary,
                    reasoning_tokens,
                };
                vec![Step::Finished(Box::new(answer))]
            }
            JobEvent::Failed(e) => vec![Step::Failed(e.into())],
        }
    }
}

/// The steps of a running job. The job is cancelled when the stream is dropped (the client
/// went away).
pub fn steps(running: Running) -> impl Stream<Item = Step> + Send {
    let Running { events, clamped, guard, backlog, .. } = running;
    let mut steps = Steps::new(clamped);
    UnboundedReceiverStream::new(events).flat_map(move |event| {
        let _keep = &guard;
        backlog.taken();
        futures_util::stream::iter(steps.next(event))
    })
}

/// The whole answer of a running job.
pub async fn collect(running: Running) -> Result<Answer, ApiError> {
    let Running { mut events, clamped, guard, backlog, .. } = running;
    let mut steps = Steps::new(clamped);
    while let Some(event) = events.recv().await {
        backlog.taken();
        for step in steps.next(event) {
            match step {
                Step::Finished(answer) => {
                    drop(guard);
                    return Ok(*answer);
                }
                Step::Failed(e) => return Err(e),
                _ => {}
            }
        }
    }
    Err(ApiError::internal("the engine ended the request without a summary"))
}

/// The request's workload class: an agent's turn when tools are offered, else code or prose by
/// its last user message; greedy or sampled by its temperature.
pub fn workload_class(prompt: &Prompt, temperature: f32) -> engine::workload::WorkloadClass {
    let text = match prompt {
        Prompt::Text(text) => text.as_str(),
        Prompt::Chat { messages, .. } => {
            messages.iter().rev().find(|m| m.role == "user").map_or("", |m| m.content.as_str())
        }
    };
    engine::workload::WorkloadClass::of(text, !crate::tool_choice::offered(prompt).is_empty(), temperature)
}

/// Runs a converted request on the loaded model — the one way the protocol handlers do: at the
/// draft depth tuned for its workload class (when there is one), through the worker; returns
/// the running job and the speed headers every answer carries.
pub async fn run(
    state: &AppState,
    loaded: &Loaded,
    prompt: Prompt,
    mut request: GenerateRequest,
) -> Result<(Running, HeaderMap), ApiError> {
    request.speculate(loaded.depth.for_class(workload_class(&prompt, request.sampling.temperature)));
    let running = loaded.worker.run(prompt, request, false).await?;
    let headers = state.speed_headers(loaded, running.max_tokens, running.clamped);
    Ok((running, headers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::JobError;

    fn delta(content: &str, calls: Vec<CallEvent>) -> JobEvent {
        JobEvent::Delta { content: content.into(), reasoning: String::new(), tool_calls: calls }
    }

    fn summary(reason: FinishReason, stop: Option<&str>) -> Summary {
        Summary {
            finish_reason: reason,
            usage: Default::default(),
            timings: Default::default(),
            speculative: None,
            stop_string: stop.map(str::to_string),
        }
    }

    #[test]
    fn calls_are_numbered_and_say_whether_they_streamed() {
        let mut s = Steps::new(None);
        let call = |n: &str| ParsedCall { name: n.into(), arguments: serde_json::json!({"a": 1}) };
        let begun = s.next(delta("", vec![CallEvent::Begin { name: "a".into() }, CallEvent::Arguments("{".into())]));
        assert!(matches!(&begun[..], [Step::CallBegin { index: 0, .. }, Step::CallArguments { index: 0, .. }]));
        let ended = s.next(delta("", vec![CallEvent::End(call("a")), CallEvent::End(call("b"))]));
        assert!(
            matches!(
                &ended[..],
                [Step::CallEnd { index: 0, streamed: true, .. }, Step::CallEnd { index: 1, streamed: false, .. }]
            ),
            "{ended:?}"
        );
        let done = s.next(JobEvent::Finished { summary: summary(FinishReason::Stop, None), reasoning_tokens: 0 });
        let [Step::Finished(answer)] = &done[..] else { panic!("{done:?}") };
        assert_eq!(answer.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn the_answer_holds_everything_and_why_it_ended() {
        let clamp = Clamp { asked: Some(100), by: ClampedBy::Context };
        let mut s = Steps::new(Some(clamp));
        s.next(JobEvent::Delta { content: "he".into(), reasoning: "hm".into(), tool_calls: vec![] });
        s.next(delta("llo", vec![]));
        let done = s.next(JobEvent::Finished { summary: summary(FinishReason::Length, None), reasoning_tokens: 1 });
        let [Step::Finished(answer)] = &done[..] else { panic!("{done:?}") };
        assert_eq!((answer.text.as_str(), answer.reasoning.as_str()), ("hello", "hm"));
        assert_eq!(answer.finish, Finish::OutOfTokens(Some(ClampedBy::Context)));
        let mut s = Steps::new(None);
        let done =
            s.next(JobEvent::Finished { summary: summary(FinishReason::Stop, Some("END")), reasoning_tokens: 0 });
        assert!(matches!(&done[..], [Step::Finished(a)] if a.finish == Finish::StopSequence));
        let failed = s.next(JobEvent::Failed(JobError::BadRequest("no".into())));
        assert!(matches!(&failed[..], [Step::Failed(e)] if e.status == 400));
    }

    #[test]
    fn a_bad_setting_names_its_field() {
        let sampling = SamplingParams { top_p: 0.0, ..Default::default() };
        let e = engine_error(sampling.validate().unwrap_err());
        assert_eq!(e.param.as_deref(), Some("top_p"), "{}", e.message);
        assert!(e.message.contains("top_p must be in (0, 1]"), "{}", e.message);
        let penalties = engine::Penalties { presence: 3.0, ..Default::default() };
        let e = engine_error(SamplingParams { penalties, ..Default::default() }.validate().unwrap_err());
        assert_eq!(e.param.as_deref(), Some("presence_penalty"));
    }
}

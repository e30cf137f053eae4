"""OpenAI's graders for reinforcement fine-tuning (method.type 'reinforcement'): their spec objects and
how each scores one sample. Torch-free: the workers grade with it, the API validates with it.

A grader reads the row (``{{item.<field>}}``: the training row's own fields) and the sample
(``{{sample.output_text}}``: what the policy wrote; ``{{sample.output_json}}``: it parsed as JSON, or
null) through template strings, and returns a float. The types, as OpenAI publishes them
(openai-openapi: GraderStringCheck, GraderTextSimilarity, GraderPython, GraderScoreModel, GraderMulti):

- ``string_check``: ``eq``, ``ne`` (1 or 0), ``like`` (the reference is a substring of the input),
  ``ilike`` (the same, case-insensitive);
- ``text_similarity``: ``fuzzy_match`` (difflib's ratio), ``bleu`` (sentence BLEU-4 with add-one smoothing
  of the 2–4-gram precisions and the brevity penalty), ``gleu`` (Google-BLEU: min of n-gram precision and
  recall, n = 1…4), ``rouge_1`` … ``rouge_5`` (n-gram F1), ``rouge_l`` (longest common subsequence F1) —
  all on lower-cased word tokens but fuzzy_match; ``cosine`` (needs an embeddings model) and ``meteor``
  (needs WordNet) are refused;
- ``python``: ``source`` defines ``grade(sample, item) -> float``, run in a sandbox (service/domain/sandbox.py);
- ``score_model``: a model memfit serves scores the sample (the workers ask it; see workers/rl.py);
- ``multi``: several named graders and ``calculate_output``, arithmetic over their names.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import re
from collections import Counter
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][\w]*)\.([\w.]+)\s*\}\}")
SUPPORTED_METRICS = ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
REFUSED_METRICS = {
    "cosine": "cosine similarity needs an embeddings model, which memfit does not serve to graders; use "
              "fuzzy_match, bleu, gleu or a rouge_* metric",
    "meteor": "METEOR needs WordNet's synonyms and a stemmer, which memfit does not ship; use bleu, gleu or rouge_l",
}


class GraderError(ValueError):
    """A grader that cannot score a sample (a template naming a field the row lacks, a python grader that
    failed): the message says which."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StringCheckGrader(_Strict):
    type: Literal["string_check"] = Field(..., description="The grader's type, 'string_check'.")
    name: str = Field(..., max_length=256, description="The grader's name (its metrics are reported under it).")
    input: str = Field(..., max_length=65536, description="The text checked; template strings allowed.")
    reference: str = Field(..., max_length=65536, description="The text it is checked against; templates allowed.")
    operation: Literal["eq", "ne", "like", "ilike"] = Field(
        ..., description="eq / ne: equal or not (1 or 0); like: the reference occurs in the input; ilike: so, "
                         "ignoring case.")


class TextSimilarityGrader(_Strict):
    type: Literal["text_similarity"] = Field("text_similarity", description="The grader's type, 'text_similarity'.")
    name: str = Field(..., max_length=256, description="The grader's name (its metrics are reported under it).")
    input: str = Field(..., max_length=65536, description="The text graded; template strings allowed.")
    reference: str = Field(..., max_length=65536, description="The text it is graded against; templates allowed.")
    evaluation_metric: Literal["cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3",
                               "rouge_4", "rouge_5", "rouge_l"] = Field(
        ..., description="fuzzy_match, bleu, gleu, rouge_1…rouge_5, rouge_l; cosine and meteor are refused.")

    @field_validator("evaluation_metric")
    @classmethod
    def _computable(cls, v):
        if v in REFUSED_METRICS:
            raise ValueError(f"evaluation_metric {v!r} is not supported: {REFUSED_METRICS[v]}")
        return v


class PythonGrader(_Strict):
    type: Literal["python"] = Field(..., description="The grader's type, 'python'.")
    name: str = Field(..., max_length=256, description="The grader's name (its metrics are reported under it).")
    source: str = Field(..., min_length=1, max_length=262144,
                        description="Python defining grade(sample: dict, item: dict) -> float, run sandboxed: no "
                                    "network, no files outside its folder, no processes, CPU, memory and time limits.")
    image_tag: str | None = Field(None, max_length=128,
                                  description="OpenAI's image of the grader; memfit runs the server's own Python "
                                              "(its standard library only) whatever the tag.")

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, v):
        try:
            tree = ast.parse(v)
        except SyntaxError as exc:
            raise ValueError(f"source does not parse: {exc.msg} (line {exc.lineno})") from None
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "grade" for n in tree.body):
            raise ValueError("source must define grade(sample, item) at its top level")
        return v


class ScoreModelSampling(_Strict):
    seed: int | None = Field(None, description="The grader model's sampling seed.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling's mass; None: 1.")
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature; None: greedy.")
    max_completions_tokens: int | None = Field(None, ge=1, le=4096, description="Longest answer; None: 8 tokens.")
    reasoning_effort: str | None = Field(None, description="Accepted; memfit's models do not reason, it is not used.")


class ScoreModelMessage(_Strict):
    role: Literal["user", "assistant", "system", "developer"] = Field(..., description="The message's role.")
    content: Union[str, list[dict[str, Any]]] = Field(
        ..., description="Text with template strings, or OpenAI's content blocks of type input_text / output_text "
                         "(images and audio are refused).")
    type: Literal["message"] | None = Field(None, description="OpenAI's 'message', or left out.")

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for i, block in enumerate(v):
                if block.get("type") not in ("input_text", "output_text") or not isinstance(block.get("text"), str):
                    raise ValueError(f"content[{i}]: only input_text and output_text blocks are supported (memfit's "
                                     "grader models read text)")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b["text"] for b in self.content)


class ScoreModelGrader(_Strict):
    type: Literal["score_model"] = Field(..., description="The grader's type, 'score_model'.")
    name: str = Field(..., max_length=256, description="The grader's name (its metrics are reported under it).")
    model: str = Field(..., min_length=1, max_length=512,
                       description="A model memfit serves (a preset, a directory under MEMFIT_MODEL_DIRS, or a "
                                   "fine-tuned ft: model); its answer's first number is the score.")
    input: list[ScoreModelMessage] = Field(..., min_length=1, max_length=64,
                                           description="The messages the grader model reads, joined as its prompt.")
    sampling_params: ScoreModelSampling | None = Field(None, description="How the grader model samples its answer.")
    range: list[float] | None = Field(None, min_length=2, max_length=2,
                                      description="The score's range, [0, 1] when left out; a score is clipped to it.")

    @field_validator("range")
    @classmethod
    def _range(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError("range must be [low, high] with low < high")
        return v


SingleGrader = Annotated[Union[StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader],
                         Field(discriminator="type")]

_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil, "exp": math.exp, "sqrt": math.sqrt,
    "log": math.log}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b if b else 0.0, ast.Pow: lambda a, b: a ** b}


def formula_names(formula: str) -> set[str]:
    """The names ``formula`` (calculate_output) reads; raises ValueError for anything but arithmetic."""
    try:
        tree = ast.parse(formula, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"calculate_output does not parse: {exc.msg}") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
                raise ValueError(f"calculate_output may call only {', '.join(_FUNCTIONS)}")
        elif isinstance(node, ast.Name):
            if node.id not in _FUNCTIONS:
                names.add(node.id)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise ValueError("calculate_output allows + - * / ** only")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise ValueError("calculate_output allows + - * / ** only")
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float)) or isinstance(node.value, bool):
                raise ValueError("calculate_output's constants must be numbers")
        elif not isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop)):
            raise ValueError(f"calculate_output allows arithmetic on the graders' names only, not {type(node).__name__}")
    return names


def calculate(formula: str, values: dict[str, float]) -> float:
    """``formula`` over ``values`` (names checked by formula_names first)."""

    def ev(node) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(values[node.id])
        if isinstance(node, ast.BinOp):
            return float(_BINARY[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.Call):
            return float(_FUNCTIONS[node.func.id](*(ev(a) for a in node.args)))
        raise ValueError(type(node).__name__)

    formula_names(formula)
    return ev(ast.parse(formula, mode="eval"))


class MultiGrader(_Strict):
    type: Literal["multi"] = Field("multi", description="The grader's type, 'multi'.")
    name: str = Field(..., max_length=256, description="The grader's name (its metrics are reported under it).")
    graders: Union[dict[str, SingleGrader], SingleGrader] = Field(
        ..., description="The graders by the names calculate_output reads (one grader: its name); label_model and "
                         "nested multi graders are refused.")
    calculate_output: str = Field(..., min_length=1, max_length=4096,
                                  description="Arithmetic (+ - * / **, min, max, abs, floor, ceil, exp, sqrt, log) "
                                              "over the graders' names.")

    @model_validator(mode="after")
    def _formula(self):
        names = formula_names(self.calculate_output)
        unknown = sorted(names - set(self.named()))
        if unknown:
            raise ValueError(f"calculate_output reads {', '.join(unknown)}, which name no grader (graders: "
                             f"{', '.join(sorted(self.named()))})")
        return self

    def named(self) -> dict[str, Any]:
        if isinstance(self.graders, dict):
            return dict(self.graders)
        return {self.graders.name: self.graders}


Grader = Annotated[Union[StringCheckGrader, TextSimilarityGrader, PythonGrader, ScoreModelGrader, MultiGrader],
                   Field(discriminator="type")]


# --- templates -------------------------------------------------------------------------------------


def _lookup(root: Any, path: list[str], where: str) -> Any:
    value = root
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise GraderError(f"{where} has no field {'.'.join(path)!r}")
    return value


def sample_view(output_text: str) -> dict[str, Any]:
    """``sample`` as graders read it: output_text, and output_json where the text parses as JSON."""
    try:
        parsed = json.loads(output_text)
    except ValueError:
        parsed = None
    return {"output_text": output_text, "output_json": parsed}


def render(template: str, item: dict, sample: dict | None) -> str:
    """``template`` with each ``{{item.x}}`` / ``{{sample.output_text}}`` replaced (non-strings as JSON)."""

    def sub(m: re.Match) -> str:
        root, path = m.group(1), m.group(2).split(".")
        if root == "item":
            value = _lookup(item, path, "the row")
        elif root == "sample":
            if sample is None:
                raise GraderError("{{sample.…}} has no sample here")
            value = _lookup(sample, path, "the sample")
        else:
            raise GraderError(f"unknown template namespace {root!r}: use item or sample")
        return value if isinstance(value, str) else json.dumps(value)

    return TEMPLATE.sub(sub, template)


def item_fields(grader: Any) -> set[str]:
    """The top-level row fields ``grader``'s templates read (each row must have them: datafmt checks)."""
    texts: list[str] = []
    if isinstance(grader, (StringCheckGrader, TextSimilarityGrader)):
        texts = [grader.input, grader.reference]
    elif isinstance(grader, ScoreModelGrader):
        texts = [m.text() for m in grader.input]
    elif isinstance(grader, MultiGrader):
        return set().union(*(item_fields(g) for g in grader.named().values()))
    out = set()
    for t in texts:
        for m in TEMPLATE.finditer(t):
            if m.group(1) == "item":
                out.add(m.group(2).split(".")[0])
    return out


def check_row(grader: Any, row: dict) -> None:
    """Raise GraderError when ``row`` lacks a field ``grader``'s templates read."""
    missing = sorted(f for f in item_fields(grader) if f not in row)
    if missing:
        raise GraderError(f"the grader {grader.name!r} reads {{{{item.{missing[0]}}}}}, which the row lacks")


# --- text similarity ---------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text.lower())


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu(hypothesis: str, reference: str, max_n: int = 4) -> float:
    """Sentence BLEU-4: geometric mean of the clipped n-gram precisions (2–4-grams add-one smoothed, Lin & Och
    2004) times the brevity penalty."""
    hyp, ref = _words(hypothesis), _words(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    logs = 0.0
    for n in range(1, max_n + 1):
        h, r = _ngrams(hyp, n), _ngrams(ref, n)
        match, total = sum((h & r).values()), max(sum(h.values()), 0)
        if n == 1:
            if match == 0:
                return 0.0
            logs += math.log(match / total)
        else:
            logs += math.log((match + 1) / (total + 1))
    penalty = 1.0 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return penalty * math.exp(logs / max_n)


def gleu(hypothesis: str, reference: str, max_n: int = 4) -> float:
    """Google-BLEU (Wu et al. 2016): over every 1…4-gram, min(matches / hypothesis n-grams, matches / reference n-grams)."""
    hyp, ref = _words(hypothesis), _words(reference)
    h = sum((_ngrams(hyp, n) for n in range(1, max_n + 1)), Counter())
    r = sum((_ngrams(ref, n) for n in range(1, max_n + 1)), Counter())
    if not h or not r:
        return float(hyp == ref)
    match = sum((h & r).values())
    return min(match / sum(h.values()), match / sum(r.values()))


def _f1(match: float, hyp: float, ref: float) -> float:
    if not match:
        return 0.0
    p, r = match / hyp, match / ref
    return 2 * p * r / (p + r)


def rouge_n(hypothesis: str, reference: str, n: int) -> float:
    h, r = _ngrams(_words(hypothesis), n), _ngrams(_words(reference), n)
    if not h or not r:
        return float(h == r)
    return _f1(sum((h & r).values()), sum(h.values()), sum(r.values()))


def rouge_l(hypothesis: str, reference: str) -> float:
    hyp, ref = _words(hypothesis), _words(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    prev = [0] * (len(ref) + 1)
    for a in hyp:
        cur = [0]
        for j, b in enumerate(ref):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    return _f1(prev[-1], len(hyp), len(ref))


def similarity(metric: str, text: str, reference: str) -> float:
    if metric == "fuzzy_match":
        return difflib.SequenceMatcher(None, text, reference).ratio()
    if metric == "bleu":
        return bleu(text, reference)
    if metric == "gleu":
        return gleu(text, reference)
    if metric == "rouge_l":
        return rouge_l(text, reference)
    if metric.startswith("rouge_"):
        return rouge_n(text, reference, int(metric[-1]))
    raise GraderError(f"evaluation_metric {metric!r} is not supported")


# --- scoring -----------------------------------------------------------------------------------------------

PythonRunner = Callable[[PythonGrader, list[tuple[dict, dict]]], list["Score"]]
ModelScorer = Callable[[ScoreModelGrader, list[str]], list[str]]  # prompts → the grader model's answers


class Score(BaseModel):
    """One sample's score; ``error`` says why a grader could not score it (the score is then 0)."""

    value: float
    error: str | None = None
    parts: dict[str, float] = Field(default_factory=dict)  # a multi grader's graders, by name


def string_check(g: StringCheckGrader, item: dict, sample: dict) -> float:
    text, ref = render(g.input, item, sample), render(g.reference, item, sample)
    if g.operation == "eq":
        return float(text == ref)
    if g.operation == "ne":
        return float(text != ref)
    if g.operation == "like":
        return float(ref in text)
    return float(ref.lower() in text.lower())


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def model_score(answer: str, grader: ScoreModelGrader) -> Score:
    """The first number of the grader model's answer, clipped to the grader's range."""
    low, high = grader.range or [0.0, 1.0]
    m = _NUMBER.search(answer)
    if m is None:
        return Score(value=low, error=f"the grader model's answer holds no number: {answer[:80]!r}")
    return Score(value=min(high, max(low, float(m.group()))))


def grade_batch(grader: Any, pairs: list[tuple[dict, str]], *, python: PythonRunner | None = None,
                model: ModelScorer | None = None) -> list[Score]:
    """Score every (row, output text) pair. ``python`` runs python graders (service/domain/sandbox.py
    run_python_grader), ``model`` asks score_model graders' models; a grader that cannot score a pair gives
    it 0 and says why in its Score."""
    samples = [(item, sample_view(text)) for item, text in pairs]
    if isinstance(grader, MultiGrader):
        named = grader.named()
        parts = {name: grade_batch(g, pairs, python=python, model=model) for name, g in named.items()}
        out = []
        for i in range(len(pairs)):
            values = {name: scores[i].value for name, scores in parts.items()}
            errors = [f"{name}: {scores[i].error}" for name, scores in parts.items() if scores[i].error]
            try:
                value = calculate(grader.calculate_output, values)
            except (ArithmeticError, ValueError) as exc:
                value, errors = 0.0, [*errors, f"calculate_output: {exc}"]
            out.append(Score(value=value, error="; ".join(errors) or None, parts=values))
        return out
    if isinstance(grader, PythonGrader):
        if python is None:
            raise GraderError("python graders need a sandbox runner")
        return python(grader, samples)
    if isinstance(grader, ScoreModelGrader):
        if model is None:
            raise GraderError("score_model graders need a model to ask")
        prompts = []
        for item, sample in samples:
            prompts.append("\n\n".join(render(m.text(), item, sample) for m in grader.input))
        return [model_score(answer, grader) for answer in model(grader, prompts)]
    out = []
    for item, sample in samples:
        try:
            if isinstance(grader, StringCheckGrader):
                value = string_check(grader, item, sample)
            else:
                value = similarity(grader.evaluation_metric, render(grader.input, item, sample),
                                   render(grader.reference, item, sample))
            out.append(Score(value=value))
        except GraderError as exc:
            out.append(Score(value=0.0, error=str(exc)))
    return out


def grader_names(grader: Any) -> list[str]:
    """The names the run's metrics report a score under: the grader's, and a multi grader's parts."""
    if isinstance(grader, MultiGrader):
        return [grader.name, *grader.named()]
    return [grader.name]

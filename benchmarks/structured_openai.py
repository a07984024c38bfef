"""Structured output's conformance over the HTTP API: N constrained chat requests sent with the
official `openai` client to a real `jaxinfer serve`, every output checked against its constraint.

    python benchmarks/structured_openai.py [MODEL] [--num-requests 1000] [--concurrency 64]
                                           [--max-tokens 256] [--seed 0]
                                           [--url http://127.0.0.1:8000] [-- `jaxinfer serve` flags]

Without --url it starts `jaxinfer serve MODEL` (default smollm2-135m) on 127.0.0.1 (a free port),
waits for /health, runs the requests and stops it. The requests (`--seed` fixes them all) are
chat.completions through `AsyncOpenAI`, at most `--concurrency` in flight at once:

- 70% `response_format={"type": "json_schema", "json_schema": {..., "strict": true}}`, spread
  over the SCHEMAS below (24: nested objects, arrays of objects and of arrays with minItems /
  maxItems, enums, integers and numbers with minimum / maximum, string patterns, optional fields,
  a nullable field and an anyOf; every string has maxLength and every array maxItems, so each
  output is bounded), the schema also shown in the prompt;
- 10% `response_format={"type": "json_object"}`;
- 10% vLLM's `extra_body={"structured_outputs": {"regex": ...}}` (REGEXES);
- 10% `extra_body={"structured_outputs": {"choice": [...]}}` (CHOICES, some sharing prefixes).

Within each kind, half the requests are greedy and half sampled (temperature 0.8-1.0, a seed
each). Each output is validated: a JSON-schema output must parse and pass `jsonschema`'s Draft
2020-12 validator, a json_object output must parse to an object, a regex output must
`re.fullmatch`, a choice output must be one of the choices. Only outputs that finished with
finish_reason "stop" are judged; those cut at `--max-tokens` ("length") may be incomplete and are
counted in their own column, never hidden. A request that fails (HTTP error, any other finish
reason) is an error. Prints a markdown table per constraint kind and overall (requests, "stop",
valid, invalid, length-capped, errors), output tok/s and wall time, the first few invalid outputs,
and exits 1 if any finished output is invalid or any request failed.

The wall time includes each schema's first compile (on the server's worker thread) and the
client's own Python, which shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from startup import parse_with_server_flags, served  # noqa: E402


# -- the constraints -------------------------------------------------------------------------
def _s(max_length: int, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


def _pat(pattern: str, max_length: int) -> dict:
    return {"type": "string", "pattern": pattern, "maxLength": max_length}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _enum(*values) -> dict:
    return {"type": "string", "enum": list(values)}


def _arr(items: dict, max_items: int, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _obj(properties: dict, optional: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties,
            "required": [k for k in properties if k not in optional],
            "additionalProperties": False}


DATE = r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
# (name, task, schema): the task opens the prompt
SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a fictional person",
     _obj({"name": _s(40), "age": _int(0, 120),
           "email": _pat(r"^[a-z0-9.]{1,20}@[a-z]{1,15}\.(com|org|net)$", 48)}, ("email",))),
    ("book", "Describe a well-known book",
     _obj({"title": _s(60), "author": _s(40), "year": _int(1450, 2030),
           "genres": _arr(_enum("fiction", "history", "science", "poetry", "biography"), 3, 1),
           "isbn": _pat(r"^97[89]-[0-9]{10}$", 14)}, ("isbn",))),
    ("weather", "Report the weather in a city",
     _obj({"city": _s(30), "temperature_c": _num(-60, 60),
           "conditions": _enum("sunny", "cloudy", "rain", "snow", "fog", "storm"),
           "humidity": _int(0, 100), "wind_kph": _num(0, 300)}, ("wind_kph",))),
    ("order", "Write an online shop order",
     _obj({"order_id": _pat(r"^ORD-[0-9]{6}$", 10),
           "items": _arr(_obj({"sku": _pat(r"^[A-Z]{3}[0-9]{3}$", 6), "quantity": _int(1, 99),
                               "price": _num(0, 10000)}), 4, 1),
           "total": _num(0, 100000), "paid": {"type": "boolean"}})),
    ("address", "Give a postal address",
     _obj({"street": _s(60), "city": _s(40), "postal_code": _pat(r"^[0-9]{5}$", 5),
           "country": _enum("US", "CA", "GB", "FR", "DE", "JP"), "unit": _s(10)}, ("unit",))),
    ("movie_review", "Review a movie",
     _obj({"movie": _s(60), "rating": _int(1, 5),
           "sentiment": _enum("positive", "negative", "mixed"), "summary": _s(200),
           "pros": _arr(_s(40), 3), "cons": _arr(_s(40), 3)}, ("pros", "cons"))),
    ("recipe", "Write a short recipe",
     _obj({"name": _s(50), "servings": _int(1, 12),
           "ingredients": _arr(_obj({"item": _s(30), "amount": _num(0, 1000),
                                     "unit": _enum("g", "kg", "ml", "l", "cup", "tbsp", "tsp",
                                                   "piece")}), 6, 1),
           "steps": _arr(_s(100), 5, 1), "vegetarian": {"type": "boolean"}})),
    ("event", "Announce a meeting",
     _obj({"title": _s(60), "date": _pat(DATE, 10),
           "start_time": _pat(r"^([01][0-9]|2[0-3]):[0-5][0-9]$", 5),
           "duration_minutes": _int(15, 480), "attendees": _arr(_s(30), 5)})),
    ("product", "Describe a product in a shop",
     _obj({"name": _s(50), "price": _num(0.01, 9999.99),
           "currency": _enum("USD", "EUR", "GBP", "JPY"), "in_stock": {"type": "boolean"},
           "tags": _arr(_s(20), 4)}, ("tags",))),
    ("employee", "Describe an employee",
     _obj({"id": _int(1, 99999), "name": _s(40),
           "department": _enum("engineering", "sales", "support", "finance", "legal"),
           "manager": _obj({"id": _int(1, 99999), "name": _s(40)}),
           "skills": _arr(_s(25), 5)}, ("manager",))),
    ("geo_point", "Give the coordinates of a landmark",
     _obj({"lat": _num(-90, 90), "lon": _num(-180, 180), "label": _s(40)}, ("label",))),
    ("palette", "Propose a colour palette",
     _obj({"name": _s(30), "colors": _arr(_pat(r"^#[0-9a-f]{6}$", 7), 5, 2)})),
    ("math_answer", "Solve: what is 17 times 23?",
     _obj({"question": _s(100), "answer": _int(-1000000, 1000000),
           "steps": _arr(_s(80), 4), "confident": {"type": "boolean"}})),
    ("classification", "Classify the e-mail 'You won a prize, click here' as spam or ham",
     _obj({"label": _enum("spam", "ham", "unknown"), "score": _num(0, 1),
           "reasons": _arr(_s(60), 3)})),
    ("flight", "Give the status of a flight",
     _obj({"flight_number": _pat(r"^[A-Z]{2}[0-9]{2,4}$", 6),
           "origin": _pat(r"^[A-Z]{3}$", 3), "destination": _pat(r"^[A-Z]{3}$", 3),
           "seats_left": _int(0, 400), "status": _enum("on_time", "delayed", "cancelled")})),
    ("todo_list", "Write a to-do list",
     _obj({"owner": _s(30),
           "tasks": _arr(_obj({"title": _s(60), "done": {"type": "boolean"},
                               "priority": _enum("low", "medium", "high")}), 5, 1)})),
    ("company", "Describe a small company and its teams",
     _obj({"company": _s(40), "hq": _obj({"city": _s(30), "country": _s(30)}),
           "teams": _arr(_obj({"name": _s(30),
                               "lead": _obj({"name": _s(40), "email": _s(48)}, ("email",)),
                               "size": _int(1, 50)}), 3, 1)})),
    ("survey", "Fill in a customer survey",
     _obj({"respondent_age": _int(18, 99), "answers": _arr(_int(1, 5), 5, 3),
           "comment": _s(120), "would_recommend": {"type": "boolean"}}, ("comment",))),
    ("api_log", "Write one web server log entry",
     _obj({"method": _enum("GET", "POST", "PUT", "DELETE"),
           "path": _pat(r"^/[a-z0-9/_-]{0,40}$", 41), "status": _int(100, 599),
           "latency_ms": _num(0, 60000), "error": _s(100)}, ("error",))),
    ("matrix", "Write a small matrix of numbers",
     _obj({"rows": _int(1, 3), "values": _arr(_arr(_num(-100, 100), 3, 1), 3, 1)})),
    ("translation", "Translate 'good morning' into French",
     _obj({"source_lang": _enum("en", "fr", "de", "es"),
           "target_lang": _enum("en", "fr", "de", "es"),
           "text": _s(100), "translation": _s(150)})),
    ("inventory", "List a warehouse's inventory",
     _obj({"warehouse": _s(30),
           "items": _arr(_obj({"name": _s(30), "count": _int(0, 10000),
                               "location": _pat(r"^[A-Z][0-9]{1,2}$", 3)}), 4, 1),
           "last_audit": _pat(DATE, 10)}, ("last_audit",))),
    ("nullable", "Describe a game player, whose nickname and score may be unknown",
     _obj({"player": _s(30), "nickname": {"type": ["string", "null"], "maxLength": 20},
           "score": {"anyOf": [_int(0, 10), {"type": "null"}]}})),
    ("quiz", "Write a multiple-choice quiz question",
     _obj({"question": _s(120), "options": _arr(_s(40), 4, 2), "answer_index": _int(0, 3),
           "difficulty": _enum("easy", "medium", "hard")})),
]

# (name, task, regex): Rust's regex syntax, written in the subset Python's `re` reads the same
REGEXES: list[tuple[str, str, str]] = [
    ("phone", "Give a US phone number.", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("date", "When did you last go on holiday? Give the date.", DATE[1:-1]),
    ("email", "Give an e-mail address for John Smith.",
     r"[a-z]{1,12}\.[a-z]{1,12}@[a-z]{2,10}\.(com|org|net)"),
    ("hex_color", "What is the hex code of a dark blue?", r"#[0-9a-f]{6}"),
    ("yes_no_reason", "Is the sky blue? Answer and explain briefly.",
     r"(Yes|No)\. [A-Z][a-z ,]{0,60}\."),
    ("ipv4", "Give the IP address of a home router.",
     r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    ("time", "What time do you usually eat lunch?", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("list", "Name up to three fruits, separated by commas.",
     r"[A-Za-z]{1,15}(, [A-Za-z]{1,15}){0,2}"),
]

# (name, task, choices)
CHOICES: list[tuple[str, str, list[str]]] = [
    ("sentiment", "What is the sentiment of: 'I loved the food but the service was slow.'?",
     ["positive", "negative", "neutral"]),
    ("capital", "What is the capital of France?", ["Paris", "London", "Berlin", "Madrid", "Rome"]),
    ("yes_no", "Is water wet?", ["yes", "no"]),
    ("prefixes", "Which city is in India?", ["New York", "New Delhi", "Newcastle", "New"]),
    ("numbers", "How many legs does a spider have?", ["2", "4", "6", "8", "10", "12"]),
]

JSON_OBJECT_TASKS = [
    "Describe a cat as a JSON object.",
    "Give the name and population of a city as a JSON object.",
    "Write a JSON object with a user's first name, last name and age.",
    "Represent a car (make, model, year) as a JSON object.",
]

KINDS = ("json_schema", "json_object", "regex", "choice")
SHARES = {"json_schema": 7, "json_object": 1, "regex": 1, "choice": 1}  # out of 10


@dataclass
class Spec:
    """One request: its constraint, prompt and sampling."""
    kind: str
    name: str
    task: str
    constraint: dict | str | list | None
    temperature: float = 0.0
    seed: int | None = None

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


def make_specs(num_requests: int, seed: int) -> list[Spec]:
    """The workload: kinds in SHARES' proportions (cycling through each kind's constraints),
    alternately greedy and sampled within each kind, in a seeded random order."""
    rng = random.Random(seed)
    pattern = [k for k in KINDS for _ in range(SHARES[k])]
    kinds = [pattern[i % len(pattern)] for i in range(num_requests)]
    seen: collections.Counter = collections.Counter()
    specs = []
    for kind in kinds:
        j = seen[kind]
        seen[kind] += 1
        if kind == "json_schema":
            name, task, c = SCHEMAS[(j // 2) % len(SCHEMAS)]
        elif kind == "regex":
            name, task, c = REGEXES[(j // 2) % len(REGEXES)]
        elif kind == "choice":
            name, task, c = CHOICES[(j // 2) % len(CHOICES)]
        else:
            task = JSON_OBJECT_TASKS[(j // 2) % len(JSON_OBJECT_TASKS)]
            name, c = "object", None
        spec = Spec(kind, name, task, c)
        if j % 2:
            spec.temperature = round(rng.uniform(0.8, 1.0), 3)
            spec.seed = rng.randrange(2**31)
        specs.append(spec)
    rng.shuffle(specs)
    return specs


def request_kwargs(spec: Spec, model: str, max_tokens: int) -> dict:
    """The `chat.completions.create` arguments of one request."""
    content = spec.task
    if spec.kind == "json_schema":
        content += (". Reply with only a JSON object matching this JSON schema:\n"
                    + json.dumps(spec.constraint))
    elif spec.kind == "choice":
        content += " Answer with one of: " + ", ".join(spec.constraint) + "."
    kw: dict = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": spec.temperature}
    if spec.seed is not None:
        kw["seed"] = spec.seed
    if spec.kind == "json_schema":
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": spec.name, "schema": spec.constraint,
                                                 "strict": True}}
    elif spec.kind == "json_object":
        kw["response_format"] = {"type": "json_object"}
    else:
        kw["extra_body"] = {"structured_outputs": {spec.kind: spec.constraint}}
    return kw


def check_output(spec: Spec, text: str) -> str | None:
    """None when `text` satisfies the request's constraint, else why not."""
    if spec.kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        if spec.kind == "json_object":
            return None if isinstance(value, dict) else f"JSON {type(value).__name__}, not object"
        import jsonschema

        errors = list(jsonschema.Draft202012Validator(spec.constraint).iter_errors(value))
        if errors:
            return "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                             for e in errors[:3])
        return None
    if spec.kind == "regex":
        return None if re.fullmatch(spec.constraint, text) else "does not fullmatch the regex"
    if spec.kind == "choice":
        return None if text in spec.constraint else "not one of the choices"
    raise ValueError(f"{spec.kind=} is not one of {KINDS}")


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Result:
    spec: Spec
    finish_reason: str | None = None
    text: str = ""
    completion_tokens: int = 0
    error: str | None = None  # the request failed
    invalid: str | None = None  # it finished ("stop") with an output its constraint refuses


@dataclass
class Tally:
    requests: int = 0
    stop: int = 0
    valid: int = 0
    invalid: int = 0
    length: int = 0
    errors: int = 0
    examples: list = field(default_factory=list)

    def add(self, r: Result) -> None:
        self.requests += 1
        if r.error is not None:
            self.errors += 1
        elif r.finish_reason == "length":
            self.length += 1
        else:
            self.stop += 1
            if r.invalid is None:
                self.valid += 1
            else:
                self.invalid += 1


async def one_request(client, spec: Spec, model: str, max_tokens: int,
                      sem: asyncio.Semaphore) -> Result:
    import openai

    async with sem:
        try:
            resp = await client.chat.completions.create(**request_kwargs(spec, model, max_tokens))
        except openai.APIError as e:
            return Result(spec, error=f"{type(e).__name__}: {e}"[:300])
    choice = resp.choices[0]
    text = choice.message.content or ""
    r = Result(spec, choice.finish_reason, text,
               resp.usage.completion_tokens if resp.usage else 0)
    if choice.finish_reason == "stop":
        r.invalid = check_output(spec, text)
    elif choice.finish_reason != "length":
        r.error = f"finish_reason={choice.finish_reason!r}"
    return r


async def run(url: str, model: str | None, specs: list[Spec], concurrency: int, max_tokens: int,
              api_key: str) -> tuple[list[Result], float]:
    import httpx
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=3600.0,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8),
                                      timeout=3600.0))
    async with client:
        if model is None:
            model = (await client.models.list()).data[0].id
        # untimed: one unconstrained request, so nothing lazy lands in the wall time
        await client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "Hi"}])
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_request(client, s, model, max_tokens, sem)
                                         for s in specs])
        return results, time.perf_counter() - t0


def report(results: list[Result], wall: float, args) -> int:
    tallies = {k: Tally() for k in KINDS}
    overall = Tally()
    for r in results:
        tallies[r.spec.kind].add(r)
        overall.add(r)
    num_tokens = sum(r.completion_tokens for r in results)
    print(f"\n{len(results)} chat requests, concurrency {args.concurrency}, max_tokens "
          f"{args.max_tokens}, half greedy / half sampled (temperature 0.8-1.0); "
          f"{len(SCHEMAS)} JSON schemas, {len(REGEXES)} regexes, {len(CHOICES)} choice lists")
    print('| constraint | requests | finished "stop" | valid | invalid | length-capped | errors |')
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, t in [*tallies.items(), ("**overall**", overall)]:
        print(f"| {name} | {t.requests} | {t.stop} | {t.valid} | {t.invalid} | {t.length} "
              f"| {t.errors} |")
    print(f"\nwall time {wall:.1f} s, {num_tokens} output tokens, "
          f"{num_tokens / wall:.1f} output tok/s, {len(results) / wall:.2f} requests/s")
    capped = collections.Counter(r.spec.name for r in results if r.finish_reason == "length"
                                 and r.error is None)
    if capped:
        print("length-capped by constraint: "
              + ", ".join(f"{n} {c}" for n, c in capped.most_common()))
    bad = [r for r in results if r.invalid is not None]
    for r in bad[:args.show_invalid]:
        how = f"T={r.spec.temperature} seed={r.spec.seed}" if r.spec.sampled else "greedy"
        print(f"\nINVALID {r.spec.kind} {r.spec.name} ({how}): {r.invalid}\n  output: {r.text!r}")
    errors = [r for r in results if r.error is not None]
    for r in errors[:args.show_invalid]:
        print(f"\nERROR {r.spec.kind} {r.spec.name}: {r.error}")
    return 1 if bad or errors else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="fixes the workload and the sampling seeds")
    p.add_argument("--show-invalid", type=int, default=5, help="invalid outputs printed at most")
    p.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"))
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    specs = make_specs(args.num_requests, args.seed)
    with served(args, extra, "structured-openai") as url:
        results, wall = asyncio.run(run(url, None, specs, args.concurrency, args.max_tokens,
                                        args.api_key or "none"))
    return report(results, wall, args)


if __name__ == "__main__":
    sys.exit(main())

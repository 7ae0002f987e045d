"""One schema of `SpecConfig`'s options, read by every front end.

The CLI's strategy flags are generated from it, the bench's spec strings
(`speculative:ngram?k=4`) and the server's `speculative` objects name the same options, and it
says which strategy reads each option — so a flag the chosen strategy would ignore is an error
everywhere. A new `SpecConfig` field needs one entry here (a test checks that every field has
one). Values are validated by `SpecConfig` itself; this module only converts text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specfork.catalog.kinds import DRAFTER_KINDS, STRATEGY_KINDS, STRATEGY_NAMES, strategy_kind
from specfork.catalog.sources import parse_drafter
from specfork.config import POLICY_NAMES, TREE_SHAPES, SpecConfig
from specfork.errors import ConfigError

# Who reads an option: "drafting" = every speculative strategy; "speculative" = the fixed
# draft-length schedules (DSpark and SPORK choose their own lengths); "dspark"; "spork".
OWNERS = ("drafting", *(s.name for s in STRATEGY_KINDS if s.drafts))
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NONE_WORDS = ("none", "null", "")


@dataclass(frozen=True, slots=True)
class SpecOption:
    """One SpecConfig field: its type (int, float, bool, str, "str?" = str or None, "floats"),
    who reads it, its help text; `cli=False` keeps it off the command line."""

    name: str
    kind: type | str
    owner: str
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    cli: bool = True

    @property
    def flag(self) -> str:
        """The command-line spelling (--max-ngram)."""
        return "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        return getattr(SpecConfig(), self.name)

    def from_text(self, text: str) -> Any:
        """The value of `text` (a flag's argument, a bench option); ConfigError if it is not one."""
        v = text.strip()
        if self.kind == "str?":
            return None if v.lower() in NONE_WORDS else text
        if self.kind is bool:
            if v.lower() in TRUE_WORDS + FALSE_WORDS:
                return v.lower() in TRUE_WORDS
            raise ConfigError(f"must be true or false, got {text!r}")
        try:
            if self.kind == "floats":
                return tuple(float(x) for x in v.split(",") if x.strip())
            if self.kind in (int, float):
                return self.kind(v)  # type: ignore[operator]
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(self.kind, "comma-separated numbers")
            raise ConfigError(f"must be {what}, got {text!r}") from None
        return text


def _o(name: str, kind: type | str, owner: str, help: str, **kw: Any) -> SpecOption:
    return SpecOption(name, kind, owner, help, **kw)


def _drafter_help() -> str:
    """The drafter option's help, from the catalog: the chain drafters, each tree strategy's
    sources (a tree-only kind described there), the defaults."""
    chains = [f"{k.usage} ({k.help})" for k in DRAFTER_KINDS if k.chain]
    text = (
        f"{', '.join(chains[:-1])} or {chains[-1]}, or several joined by + and asked in order "
        "(e.g. ngram+head: the first draft wins)"
    )
    for tree in (s for s in STRATEGY_KINDS if s.tree):
        names = [
            k.usage if k.chain else f"{k.usage} ({k.help})"
            for k in DRAFTER_KINDS
            if tree.accepts(k)
        ]
        text += f"; for {tree.name} one or more of {', '.join(names)} joined by +"
    default = SpecConfig().drafter
    others = [
        f"{s.default_drafter} for {s.name}" for s in STRATEGY_KINDS if s.default_drafter != default
    ]
    return f"{text} (default: {'; '.join([str(default), *others])})"


SPEC_OPTIONS: tuple[SpecOption, ...] = (
    _o("drafter", "str?", "drafting", _drafter_help()),
    _o("k", int, "speculative", "draft length (the maximum for linear-decay)"),
    _o(
        "k_policy",
        str,
        "speculative",
        "how the draft length changes from round to round",
        choices=POLICY_NAMES,
    ),
    _o("self_layers", "str?", "drafting", "self drafter: layers it runs (early exit), e.g. 0-11"),
    _o("skip_layers", "str?", "drafting", "self drafter: layers it skips, e.g. 10-19"),
    _o("max_ngram", int, "drafting", "ngram drafter: longest n tried"),
    _o("min_ngram", int, "drafting", "ngram drafter: shortest n tried"),
    _o(
        "goodput",
        bool,
        "drafting",
        "verify only the part of a draft expected to pay for its "
        "verification rows (--no-goodput: every draft as drafted)",
    ),
    _o(
        "payback",
        bool,
        "drafting",
        "with the goodput gate, stop drafting for a while when drafting rounds emitted fewer "
        "tokens per second than plain rounds (--no-payback: draft whenever the gate says)",
    ),
    _o(
        "cascade",
        bool,
        "drafting",
        "chains: with a drafter of free sources and a head (ngram+head, suffix+head), the "
        "head checks a short chain of the free sources (up to 3 tokens; longer ones go "
        "unchecked), cuts it before the first token it finds 10x less likely than its own "
        "choice and extends it with its own tokens (--no-cascade: the first source's draft "
        "wins)",
    ),
    _o(
        "grammar_drafts",
        bool,
        "drafting",
        "with a JSON schema, regex or required tool call, also draft the tokens the grammar "
        "forces (a key, the rest of a name, punctuation), verified like any draft "
        "(--no-grammar-drafts: only the drafter's tokens)",
    ),
    _o(
        "expected_length",
        int,
        "speculative",
        "T of the linear-decay policy (the CLI sets it from --max-new-tokens)",
        cli=False,
    ),
    _o("min_k", int, "dspark", "shortest draft"),
    _o("max_k", int, "dspark", "longest draft"),
    _o("low", float, "dspark", "confidence at or below which K = min-k"),
    _o("high", float, "dspark", "confidence at or above which K = max-k"),
    _o(
        "weights",
        "floats",
        "dspark",
        "weights of the confidence signals",
        metavar="TOP1,MARGIN,EMA",
    ),
    _o("ema_rate", float, "dspark", "rate of the acceptance EMA, in (0, 1]"),
    _o("margin_scale", float, "dspark", "the top-1/top-2 margin counts min(scale * margin, 1)"),
    _o("forks", int, "spork", "first-level forks"),
    _o("depth", int, "spork", "tokens per fork"),
    _o(
        "tree",
        str,
        "spork",
        "forks = forks x depth; dynamic = the budget best nodes",
        choices=TREE_SHAPES,
    ),
    _o("budget", int, "spork", "most tree nodes"),
    _o("tau", float, "spork", "prune nodes whose prior score is below this, in [0, 1)"),
    _o(
        "tau_max",
        float,
        "spork",
        "highest tau the controller may reach (with --tau as a floor "
        "for this bound), in [0, 1); 0: nothing pruned",
    ),
    _o("target_acceptance", float, "spork", "acceptance the tau controller steers toward"),
    _o("adapt", bool, "spork", "adapt forks, depth and tau as the run goes (--no-adapt: fixed)"),
    _o(
        "recycle_persist", bool, "spork", "keep the recycle table across requests (Token Recycling)"
    ),
    _o(
        "recycle_prior",
        bool,
        "spork",
        "start the recycle table from the target's prediction "
        "after every token (computed once per model, ~25 s, and cached)",
    ),
    _o("lossy_typical", bool, "spork", "LOSSY: Medusa typical acceptance, not exact verification"),
    _o("typical_epsilon", float, "spork", "lossy typical acceptance: epsilon"),
    _o("typical_delta", float, "spork", "lossy typical acceptance: delta"),
)
OPTIONS_BY_NAME = {o.name: o for o in SPEC_OPTIONS}


def option(name: str, where: str = "") -> SpecOption:
    """The option called `name` (`-` may stand for `_`); ConfigError naming the valid ones."""
    found = OPTIONS_BY_NAME.get(name.replace("-", "_"))
    if found is None:
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}unknown option {name!r}; valid options: {', '.join(OPTIONS_BY_NAME)}"
        )
    return found


def reads(strategy: str, opt: SpecOption) -> bool:
    """Whether `strategy` uses option `opt`."""
    if not strategy_kind(strategy).drafts:
        return False
    if opt.owner == "drafting":
        return True
    return opt.owner == strategy


@dataclass(frozen=True, slots=True)
class Wording:
    """How a front end names options and strategies in its error messages."""

    noun: str = "option"
    spell: Any = None  # option -> how the user writes it (default: its field name)
    strategy: Any = None  # strategy name -> how the user writes it (default: "strategy NAME")
    this: str = "this one"  # what is being configured ("this run", "this request")

    def option(self, opt: SpecOption) -> str:
        return self.spell(opt) if self.spell else opt.name

    def name(self, strategy: str) -> str:
        return self.strategy(strategy) if self.strategy else f"strategy {strategy}"


PLAIN_WORDING = Wording()


def check_used(strategy: str, names: list[str], wording: Wording = PLAIN_WORDING) -> None:
    """ConfigError for the first option of `names` that `strategy` does not read, naming the
    strategy that does."""
    if strategy not in STRATEGY_NAMES:
        return  # SpecConfig names the valid strategies
    for name in names:
        opt = OPTIONS_BY_NAME[name]
        if reads(strategy, opt):
            continue
        if not strategy_kind(strategy).drafts:
            raise ConfigError(
                f"{wording.option(opt)} needs a speculative strategy; "
                f"{wording.name(strategy)} drafts nothing"
            )
        raise ConfigError(
            f"{wording.option(opt)} is {_article(wording.noun)} {wording.noun} of "
            f"{wording.name(opt.owner)}; {wording.this} uses {wording.name(strategy)}"
            + _instead(strategy, opt)
        )


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _instead(strategy: str, opt: SpecOption) -> str:
    sized_by = strategy_kind(strategy).sized_by
    return f" ({sized_by})" if opt.name in ("k", "k_policy") and sized_by else ""


def implied_strategy(names: list[str], wording: Wording = PLAIN_WORDING) -> str | None:
    """The strategy a set of given options implies when none was named (None: plain)."""
    owners = {OPTIONS_BY_NAME[n].owner for n in names} - {"drafting"}
    if len(owners) > 1:
        raise ConfigError(
            f"{wording.noun}s of several strategies given ({', '.join(sorted(owners))}); "
            "choose one strategy"
        )
    if owners:
        return owners.pop()
    return "speculative" if names else None


def spec_with(base: SpecConfig, values: Mapping[str, Any]) -> SpecConfig:
    """`base` with `values` replaced (`strategy` may be among them; validated). A new strategy
    without a drafter gets its own default drafter (recycle for spork, ngram otherwise); the
    base's self layers go with its self drafter."""
    changes = dict(values)
    strategy = changes.get("strategy", base.strategy)
    if "drafter" not in changes and strategy != base.strategy:
        changes["drafter"] = None
    if not _names_self(changes.get("drafter", base.drafter), strategy):
        for name in ("self_layers", "skip_layers"):
            changes.setdefault(name, None)
    return dataclasses.replace(base, **changes)


def _names_self(drafter: Any, strategy: Any) -> bool:
    """Whether `drafter` (None: `strategy`'s default) has the self drafter among its sources;
    True for values SpecConfig refuses anyway (it names their own error first)."""
    try:
        kind = strategy_kind(strategy)
        sources = parse_drafter(kind.default_drafter if drafter is None else drafter, kind)
    except ConfigError:
        return True
    return any(source.kind == "self" for source in sources)

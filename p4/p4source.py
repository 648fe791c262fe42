"""A small, strict reader of luwu's own P4 sources: what P4Runtime can see in them.

p4c is not needed to know a program's control-plane surface: this module preprocesses a
top-level program (`#include "..."`, `#define`, `#ifndef`/`#ifdef`/`#else`/`#endif`, object-like
macros only), then reads the declarations that matter to P4Info: typedefs, headers and structs
(for key bit widths), controls with their parameters, actions, tables (keys, action lists,
default action, size), extern instances (register, counter and their TNA spellings) and
sub-control instances, and the package instantiation that roots the control-plane names.

It understands exactly the subset of P4_16 that luwu's programs use and fails loudly on
anything else inside a control, so a construct it cannot see never silently drops out of the
generated P4Info. It is not a P4 compiler: statement bodies are skipped, not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class P4SourceError(ValueError):
    """A construct the reader does not understand, with its file position."""


# Types and fields the architecture files declare (p4include/v1model.p4, tna.p4) that luwu's
# keys and parameters use: name -> {field: bit width}; typedefs -> width.
BUILTIN_STRUCTS: dict[str, dict[str, int]] = {
    "standard_metadata_t": {"ingress_port": 9, "egress_spec": 9, "egress_port": 9, "instance_type": 32,
                            "packet_length": 32, "mcast_grp": 16, "egress_rid": 16, "checksum_error": 1,
                            "priority": 3},
    "ingress_intrinsic_metadata_t": {"resubmit_flag": 1, "packet_version": 2, "ingress_port": 9,
                                     "ingress_mac_tstamp": 48},
    "egress_intrinsic_metadata_t": {"egress_port": 9, "egress_rid": 16, "egress_rid_first": 1,
                                    "egress_qid": 7, "pkt_length": 16},
}
BUILTIN_TYPEDEFS: dict[str, int] = {"PortId_t": 9, "MulticastGroupId_t": 16, "QueueId_t": 7, "ReplicationId_t": 16}
ARCH_INCLUDES = {"core.p4", "v1model.p4", "tna.p4", "t2na.p4"}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<num>\d+[ws]0[xX][0-9a-fA-F_]+|\d+[ws]\d[\d_]*|0[xX][0-9a-fA-F_]+|0[bB][01_]+|\d[\d_]*)
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>&&&|<<|>>|==|!=|<=|>=|&&|\|\||\+\+|\|\+\||\|-\||[-+*/%&|^~!<>=?:;,.(){}\[\]@])
""", re.X)


@dataclass
class Token:
    kind: str
    text: str
    where: str


def strip_comments(text: str) -> str:
    """Remove /* */ and // comments, keeping line breaks so positions stay meaningful."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def preprocess(path: Path, defines: dict[str, str] | None = None,
               overrides: dict[Path, str] | None = None) -> tuple[list[tuple[str, str]], set[str]]:
    """Expand includes and conditionals of `path`: ([(location, line)], architecture includes).

    `overrides` maps resolved file paths to the text to read instead of the file (used to
    derive P4Info from freshly generated sources before they are written).
    """
    overrides = {Path(k).resolve(): v for k, v in (overrides or {}).items()}
    macros: dict[str, str] = dict(defines or {})
    lines: list[tuple[str, str]] = []
    arch: set[str] = set()

    def expand(line: str, depth: int = 0) -> str:
        if depth > 16:
            raise P4SourceError(f"macro expansion too deep in {line!r}")
        out = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: macros.get(m.group(0), m.group(0)), line)
        return out if out == line else expand(out, depth + 1)

    def walk(file: Path, seen: tuple[Path, ...]) -> None:
        if file in seen:
            raise P4SourceError(f"include cycle through {file}")
        stack: list[bool] = []  # one entry per open conditional: is this branch active?
        text = overrides[file] if file in overrides else file.read_text()
        for number, raw in enumerate(strip_comments(text).splitlines(), 1):
            where = f"{file.name}:{number}"
            line = raw.strip()
            active = all(stack)
            if line.startswith("#"):
                words = line[1:].split(None, 2)
                if not words:
                    continue
                directive = words[0]
                if directive in ("ifndef", "ifdef"):
                    stack.append((words[1] in macros) == (directive == "ifdef"))
                elif directive == "else":
                    if not stack:
                        raise P4SourceError(f"{where}: #else without #if")
                    stack[-1] = not stack[-1]
                elif directive == "endif":
                    if not stack:
                        raise P4SourceError(f"{where}: #endif without #if")
                    stack.pop()
                elif not active:
                    continue
                elif directive == "define":
                    if "(" in words[1]:
                        raise P4SourceError(f"{where}: function-like macros are not supported")
                    macros[words[1]] = words[2] if len(words) > 2 else ""
                elif directive == "include":
                    target = line[len("#include"):].strip()
                    if target.startswith("<"):
                        arch.add(target.strip("<>"))
                        if target.strip("<>") not in ARCH_INCLUDES:
                            raise P4SourceError(f"{where}: unknown system include {target}")
                    else:
                        walk((file.parent / target.strip('"')).resolve(), seen + (file,))
                else:
                    raise P4SourceError(f"{where}: unsupported directive #{directive}")
                continue
            if active and line:
                lines.append((where, expand(line)))
        if stack:
            raise P4SourceError(f"{file.name}: unterminated #if")

    walk(Path(path).resolve(), ())
    return lines, arch


def tokenize(lines: list[tuple[str, str]]) -> list[Token]:
    tokens: list[Token] = []
    for where, line in lines:
        pos = 0
        while pos < len(line):
            m = _TOKEN.match(line, pos)
            if not m:
                raise P4SourceError(f"{where}: cannot read {line[pos:pos + 20]!r}")
            pos = m.end()
            if m.lastgroup != "ws":
                tokens.append(Token(m.lastgroup, m.group(0), where))
    return tokens


def eval_int(tokens: list[Token]) -> int:
    """Value of a constant integer expression (literals, + - * / % << >> & | ~ parentheses)."""
    allowed = {"+", "-", "*", "/", "%", "<<", ">>", "&", "|", "~", "(", ")"}
    parts = []
    for t in tokens:
        if t.kind == "num":
            parts.append(str(_literal(t.text)))
        elif t.text in allowed:
            parts.append("//" if t.text == "/" else t.text)
        else:
            raise P4SourceError(f"{t.where}: {t.text!r} in what must be a constant integer expression")
    if not parts:
        raise P4SourceError("empty constant expression")
    return int(eval(" ".join(parts), {"__builtins__": {}}))  # noqa: S307 - only literals and operators


def _literal(text: str) -> int:
    """An integer literal, with or without a width prefix (32w0xFF, 8s5, 0b101, 1_000)."""
    m = re.fullmatch(r"\d+[ws](.+)", text)
    body = (m.group(1) if m else text).replace("_", "")
    return int(body, 0)


@dataclass
class Annotations:
    items: dict[str, list[Token]] = field(default_factory=dict)

    def get_int(self, name: str) -> int | None:
        return eval_int(self.items[name]) if name in self.items else None

    def get_str(self, name: str) -> str | None:
        if name not in self.items:
            return None
        toks = self.items[name]
        if len(toks) != 1 or toks[0].kind != "str":
            raise P4SourceError(f"{toks[0].where if toks else '?'}: @{name} needs one string")
        return toks[0].text[1:-1]

    def has(self, name: str) -> bool:
        return name in self.items


@dataclass
class Param:
    name: str
    type: str  # "bit<N>", "int<N>", "bool" or a type name
    direction: str = ""


@dataclass
class Action:
    name: str
    params: list[Param]
    annotations: Annotations


@dataclass
class KeyElement:
    expr: str
    match_kind: str
    annotations: Annotations


@dataclass
class ActionRef:
    name: str
    annotations: Annotations


@dataclass
class Table:
    name: str
    keys: list[KeyElement]
    actions: list[ActionRef]
    default_action: str | None
    const_default: bool
    size: int | None
    annotations: Annotations


@dataclass
class Instance:
    """An extern or control instantiation inside a control (or at top level)."""

    type: str
    type_args: str  # e.g. "bit<32>,bit<32>"
    args: list[list[Token]]
    name: str
    annotations: Annotations


@dataclass
class Control:
    name: str
    params: list[Param]
    actions: list[Action] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    instances: list[Instance] = field(default_factory=list)
    body: str = ""  # apply block text, for usage checks


@dataclass
class Program:
    typedefs: dict[str, str] = field(default_factory=dict)
    structs: dict[str, dict[str, str]] = field(default_factory=dict)  # headers and structs
    controls: dict[str, Control] = field(default_factory=dict)
    top_instances: list[Instance] = field(default_factory=list)
    arch: set[str] = field(default_factory=set)

    def width(self, type_name: str) -> int:
        """Bit width of a bit<N>/int<N>/bool type or a typedef of one."""
        m = re.fullmatch(r"(?:bit|int)<(\d+)>", type_name)
        if m:
            return int(m.group(1))
        if type_name == "bool":
            return 1
        if type_name in self.typedefs:
            return self.width(self.typedefs[type_name])
        if type_name in BUILTIN_TYPEDEFS:
            return BUILTIN_TYPEDEFS[type_name]
        raise P4SourceError(f"type {type_name} has no bit width")

    def field_width(self, control: Control, expr: str) -> int:
        """Bit width of a dotted field expression (`hdr.luwu.session`) seen from `control`."""
        parts = expr.split(".")
        params = {p.name: p.type for p in control.params}
        if parts[0] not in params:
            raise P4SourceError(f"{control.name}: key {expr} does not start with a parameter")
        type_name = params[parts[0]]
        for name in parts[1:]:
            if type_name in BUILTIN_STRUCTS:
                fields = {k: f"bit<{w}>" for k, w in BUILTIN_STRUCTS[type_name].items()}
            elif type_name in self.structs:
                fields = self.structs[type_name]
            else:
                raise P4SourceError(f"{control.name}: {expr}: {type_name} is not a struct or header")
            if name not in fields:
                raise P4SourceError(f"{control.name}: {expr}: {type_name} has no field {name}")
            type_name = fields[name]
        return self.width(type_name)


class _Reader:
    def __init__(self, tokens: list[Token]):
        self.toks = tokens
        self.i = 0

    def peek(self, k: int = 0) -> Token | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def at(self, text: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t.text == text

    def next(self) -> Token:
        if self.i >= len(self.toks):
            raise P4SourceError("unexpected end of program")
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, text: str) -> Token:
        t = self.next()
        if t.text != text:
            raise P4SourceError(f"{t.where}: expected {text!r}, found {t.text!r}")
        return t

    def ident(self) -> str:
        t = self.next()
        if t.kind != "id":
            raise P4SourceError(f"{t.where}: expected a name, found {t.text!r}")
        return t.text

    def balanced(self, open_: str, close: str) -> list[Token]:
        """Tokens between a matching pair, the opening one being next."""
        self.expect(open_)
        depth, out = 1, []
        while True:
            t = self.next()
            if t.text == open_:
                depth += 1
            elif t.text == close:
                depth -= 1
                if depth == 0:
                    return out
            out.append(t)

    def until(self, *stops: str) -> list[Token]:
        """Tokens up to (not including) the first stop at bracket depth 0."""
        out, depth = [], 0
        while True:
            t = self.peek()
            if t is None:
                raise P4SourceError(f"unexpected end looking for {stops}")
            if depth == 0 and t.text in stops:
                return out
            if t.text in ("(", "[", "{"):
                depth += 1
            elif t.text in (")", "]", "}"):
                depth -= 1
            out.append(self.next())

    def annotations(self) -> Annotations:
        ann = Annotations()
        while self.at("@"):
            self.next()
            name = self.ident()
            ann.items[name] = self.balanced("(", ")") if self.at("(") else []
        return ann

    def angle(self) -> list[str]:
        """Texts of a type argument list `<...>` (next token is `<`); `>>` closes two levels."""
        self.expect("<")
        depth, out = 1, []
        while True:
            t = self.next().text
            depth += (t == "<") - (t == ">") - 2 * (t == ">>")
            if depth < 0:
                raise P4SourceError("unbalanced `>>` in a type argument list")
            if depth == 0:
                if t == ">>":  # closed a nested list and this one
                    out.append(">")
                return out
            out.append(t)

    def type(self) -> str:
        name = self.ident()
        if self.at("<"):
            return f"{name}<{''.join(self.angle())}>"
        return name

    def params(self) -> list[Param]:
        toks = self.balanced("(", ")")
        out = []
        for chunk in _split(toks, ","):
            if not chunk:
                continue
            sub = _Reader(chunk)
            sub.annotations()
            direction = sub.next().text if sub.peek().text in ("in", "out", "inout") else ""
            ptype = sub.type()
            out.append(Param(sub.ident(), ptype, direction))
        return out


def _split(tokens: list[Token], sep: str) -> list[list[Token]]:
    parts, cur, depth = [], [], 0
    for t in tokens:
        if t.text in ("(", "[", "{"):
            depth += 1
        elif t.text in (")", "]", "}"):
            depth -= 1
        if t.text == sep and depth == 0:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return parts


def _table(r: _Reader, name: str, ann: Annotations) -> Table:
    body = _Reader(r.balanced("{", "}"))
    table = Table(name, [], [], None, False, None, ann)
    while body.peek() is not None:
        const = body.at("const")
        if const:
            body.next()
        prop = body.ident()
        body.expect("=")
        if prop == "key":
            elems = _Reader(body.balanced("{", "}"))
            while elems.peek() is not None:
                expr = "".join(t.text for t in elems.until(":"))
                elems.expect(":")
                kind = elems.ident()
                table.keys.append(KeyElement(expr, kind, elems.annotations()))
                elems.expect(";")
        elif prop == "actions":
            refs = _Reader(body.balanced("{", "}"))
            while refs.peek() is not None:
                a = refs.annotations()
                table.actions.append(ActionRef(refs.ident(), a))
                if refs.at("("):
                    refs.balanced("(", ")")
                refs.expect(";")
        elif prop == "default_action":
            table.default_action = body.ident()
            table.const_default = const
            if body.at("("):
                body.balanced("(", ")")
            body.expect(";")
        elif prop == "size":
            table.size = eval_int(body.until(";"))
            body.expect(";")
        else:
            raise P4SourceError(f"table {name}: unsupported property {prop}")
    return table


def _control(r: _Reader, name: str) -> Control:
    control = Control(name, r.params())
    body = _Reader(r.balanced("{", "}"))
    while body.peek() is not None:
        ann = body.annotations()
        t = body.peek()
        if t.text == "apply":
            body.next()
            control.body = " ".join(x.text for x in body.balanced("{", "}"))
            if body.peek() is not None:
                raise P4SourceError(f"{body.peek().where}: declarations after apply in control {name}")
        elif t.text == "action":
            body.next()
            aname = body.ident()
            control.actions.append(Action(aname, body.params(), ann))
            body.balanced("{", "}")
        elif t.text == "table":
            body.next()
            control.tables.append(_table(body, body.ident(), ann))
        elif t.text in ("bit", "int", "bool") or (t.kind == "id" and body.at(";", 2)) or body.at("=", 2):
            body.until(";")  # a local variable
            body.expect(";")
        elif t.kind == "id":
            itype = body.ident()
            targs = "".join(body.angle()) if body.at("<") else ""
            args = _split(body.balanced("(", ")"), ",")
            iname = body.ident()
            if body.at("="):  # TNA RegisterAction / Hash initialiser block
                body.next()
                body.balanced("{", "}")
            body.expect(";")
            control.instances.append(Instance(itype, targs, [a for a in args if a], iname, ann))
        else:
            raise P4SourceError(f"{t.where}: unsupported declaration {t.text!r} in control {name}")
    return control


def read_program(path: Path, defines: dict[str, str] | None = None,
                 overrides: dict[Path, str] | None = None) -> Program:
    """Parse the top-level P4 program at `path` (and everything it includes)."""
    lines, arch = preprocess(path, defines, overrides)
    r = _Reader(tokenize(lines))
    prog = Program(arch=arch)
    while r.peek() is not None:
        ann = r.annotations()
        t = r.next()
        if t.text == "typedef":
            ttype = r.type()
            prog.typedefs[r.ident()] = ttype
            r.expect(";")
        elif t.text in ("const",):
            r.until(";")
            r.expect(";")
        elif t.text in ("header", "struct"):
            sname = r.ident()
            fields: dict[str, str] = {}
            inner = _Reader(r.balanced("{", "}"))
            while inner.peek() is not None:
                inner.annotations()
                ftype = inner.type()
                fields[inner.ident()] = ftype
                inner.expect(";")
            prog.structs[sname] = fields
        elif t.text in ("function", "parser", "error", "match_kind", "enum", "extern"):
            r.until("{")
            r.balanced("{", "}")
        elif t.text == "control":
            cname = r.ident()
            if r.at(";"):
                r.next()
                continue
            prog.controls[cname] = _control(r, cname)
        elif t.kind == "id":
            args = _split(r.balanced("(", ")"), ",")
            iname = r.ident()
            r.expect(";")
            prog.top_instances.append(Instance(t.text, "", [a for a in args if a], iname, ann))
        else:
            raise P4SourceError(f"{t.where}: unsupported top-level {t.text!r}")
    return prog

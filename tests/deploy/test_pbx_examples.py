"""The PBX examples in sip_config/asterisk/ and sip_config/freeswitch/, checked by syntax (Asterisk and
FreeSWITCH are not installable here: Debian ships neither): the Asterisk files parse as Asterisk's config
format and every reference inside them resolves; the FreeSWITCH files are well-formed XML with the gateway
the dialplan bridges to. tests/integration/test_pbx_examples.py runs the INVITE each makes against the gateway.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASTERISK = ROOT / "sip_config" / "asterisk"
FREESWITCH = ROOT / "sip_config" / "freeswitch"


def asterisk_sections(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """Asterisk's config format: `[name]` sections of `key = value` / `key => value` lines, `;` comments.
    Section names may repeat (pjsip.conf tells them apart by `type`), so this is a list, not a dict."""
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = re.sub(r"(?<!\\);.*", "", raw).strip()
        if not line:
            continue
        header = re.fullmatch(r"\[([\w.-]+)\](\([!\w,]*\))?", line)
        if header:
            sections.append((header.group(1), []))
            continue
        pair = re.fullmatch(r"([\w.-]+)\s*=>?\s*(.*)", line)
        assert pair and sections, f"{path.name}:{number}: not a section or a key=value line: {raw!r}"
        sections[-1][1].append((pair.group(1), pair.group(2).strip()))
    return sections


def pjsip_objects() -> dict[tuple[str, str], dict[str, str]]:
    objects = {}
    for name, pairs in asterisk_sections(ASTERISK / "pjsip.conf"):
        options = dict(pairs)
        assert len(options) == len(pairs), f"[{name}] sets an option twice"
        objects[(options["type"], name)] = options
    return objects


def test_pjsip_conf_defines_a_g711_endpoint_whose_references_resolve():
    objects = pjsip_objects()
    endpoint = objects[("endpoint", "cosyvoice")]
    assert ("transport", endpoint["transport"]) in objects
    assert ("aor", endpoint["aors"]) in objects
    assert (endpoint["disallow"], endpoint["allow"]) == ("all", "ulaw,alaw")  # what the gateway speaks
    assert endpoint["dtmf_mode"] == "rfc4733"
    identify = objects[("identify", "cosyvoice")]
    assert identify["endpoint"] == "cosyvoice"
    contact = objects[("aor", "cosyvoice")]["contact"]
    assert re.fullmatch(r"sip:[\d.]+:\d+", contact) and identify["match"] == contact[4:].split(":")[0]


def dialplan() -> dict[str, list[tuple[str, str, str, str]]]:
    """context -> [(exten, priority, application, argument)] with `same =>` resolved to its exten."""
    contexts: dict[str, list[tuple[str, str, str, str]]] = {}
    for context, pairs in asterisk_sections(ASTERISK / "extensions.conf"):
        lines = contexts.setdefault(context, [])
        for key, value in pairs:
            assert key in ("exten", "same"), f"[{context}] {key}: not a dialplan line"
            if key == "exten":
                exten, _, value = value.partition(",")
            else:
                exten = lines[-1][0]
            priority, _, call = value.partition(",")
            app = re.fullmatch(r"(\w+)\((.*)\)", call)
            assert app, f"[{context}] {value}: not App(arguments)"
            argument = app.group(2)
            depth = 0
            for ch in argument:  # parentheses, ${...} and $[...] must balance inside the argument
                depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
                assert depth >= 0, f"[{context}] {value}: unbalanced"
            assert depth == 0, f"[{context}] {value}: unbalanced"
            lines.append((exten, priority, app.group(1), argument))
    return contexts


def test_the_dial_adds_x_tts_text_in_a_b_handler_that_exists():
    contexts = dialplan()
    steps = contexts["cosyvoice-tts"]
    assert [p for _, p, _, _ in steps] == ["1"] + ["n"] * (len(steps) - 1)
    sets = [arg for _, _, app, arg in steps if app == "Set"]
    assert any(arg.startswith("_TTS_TEXT=") for arg in sets), "the text must be inherited by the dialed channel"
    (dial,) = [arg for _, _, app, arg in steps if app == "Dial"]
    target, _timeout, options = dial.split(",", 2)
    objects = pjsip_objects()
    technology, _, resource = target.partition("/")
    assert technology == "PJSIP" and ("endpoint", resource.split("@")[1]) in objects
    handler = re.fullmatch(r"b\(([\w-]+)\^(\w+)\^(\d+)(\(.*\))?\)", options)
    assert handler, f"Dial options {options!r}: expected b(context^exten^priority(args))"
    context, exten, priority = handler.group(1, 2, 3)
    gosub = [step for step in contexts[context] if step[0] == exten]
    assert gosub[0][1] == priority
    header_sets = [arg for _, _, app, arg in gosub if app == "Set"]
    assert any(arg.startswith("PJSIP_HEADER(add,X-TTS-Text)=${URIENCODE(${TTS_TEXT})}") for arg in header_sets)
    assert gosub[-1][2] == "Return"


def test_freeswitch_gateway_and_dialplan_are_well_formed_and_agree():
    gateway = ET.parse(FREESWITCH / "cosyvoice.xml").getroot()
    assert gateway.tag == "include"
    (gw,) = gateway.findall("gateway")
    params = {p.get("name"): p.get("value") for p in gw.findall("param")}
    assert params["register"] == "false" and re.fullmatch(r"[\d.]+:\d+", params["proxy"])

    plan = ET.parse(FREESWITCH / "dialplan.xml").getroot()
    (extension,) = plan.findall("extension")
    condition = extension.find("condition")
    assert condition.get("field") == "destination_number" and re.compile(condition.get("expression"))
    actions = [(a.get("application"), a.get("data")) for a in condition.findall("action")]
    (bridge,) = [data for app, data in actions if app == "bridge"]
    variables, endpoint = re.fullmatch(r"\{(.*)\}(.*)", bridge).groups()
    assert endpoint == f"sofia/gateway/{gw.get('name')}/tts"
    # {a=b,c=d}: an unescaped comma separates variables, so each item must be one assignment
    items = dict(item.split("=", 1) for item in re.split(r"(?<!\\),", variables))
    assert items["sip_h_X-TTS-Text"] == "${tts_text}" and "sip_h_X-TTS-Voice" in items
    (text,) = [data for app, data in actions if app == "set" and data.startswith("tts_text=")]
    assert "," not in text.replace("\\,", ""), "a comma in the text would end the variable early"


@pytest.mark.parametrize("path", sorted(ASTERISK.glob("*.conf")) + sorted(FREESWITCH.glob("*.xml")),
                         ids=lambda p: p.name)
def test_every_example_file_says_where_it_goes(path):
    head = path.read_text(encoding="utf-8")[:600]
    assert re.search(r"/etc/asterisk/|conf/(sip_profiles|dialplan)/", head), "say where the file is installed"


def test_the_readme_quotes_the_files_as_they_are():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("### From Asterisk, FreeSWITCH")
    section = readme[start:readme.index("\n#", start + 1)]  # up to the next heading
    quoted = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]
    files = {line.strip() for path in [*ASTERISK.glob("*.conf"), *FREESWITCH.glob("*.xml")]
             for line in path.read_text(encoding="utf-8").splitlines()}
    assert len(quoted) >= 8 and [line for line in quoted if line not in files] == []

"""`<say-as>` in words: numbers, digits, telephone numbers, dates, times and money read out in English or Mandarin.

Pure functions from (the element's text, its attributes, the language) to the words an engine speaks, so a
number is read the same way whatever the engine's own text normaliser would guess. A value this module cannot
read raises `SayAsError` (the document is refused with a 400 naming the value), never a half-read number.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Lang = str  # "en" or "zh"


class SayAsError(ValueError):
    """A say-as value that does not fit its interpret-as (e.g. a date that is no date)."""


# -- English -------------------------------------------------------------------------------------------
_EN_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
            "sixteen seventeen eighteen nineteen").split()
_EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_EN_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_EN_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                     "nine": "ninth", "twelve": "twelfth"}
_EN_MONTHS = ("January February March April May June July August September October November December").split()
MAX_NUMBER = 10**15 - 1


def _en_below_1000(n: int) -> str:
    words = []
    if n >= 100:
        words.append(f"{_EN_ONES[n // 100]} hundred")
        n %= 100
    if n >= 20:
        words.append(_EN_TENS[n // 10] + (f"-{_EN_ONES[n % 10]}" if n % 10 else ""))
    elif n or not words:
        words.append(_EN_ONES[n])
    return " ".join(words)


def en_cardinal(n: int) -> str:
    if n < 0:
        return "minus " + en_cardinal(-n)
    if n < 1000:
        return _en_below_1000(n)
    words = []
    for scale, name in _EN_SCALES:
        if n >= scale:
            words.append(f"{en_cardinal(n // scale)} {name}")
            n %= scale
    if n:
        words.append(_en_below_1000(n))
    return " ".join(words)


def en_ordinal(n: int) -> str:
    words = en_cardinal(n)
    head, sep, last = words.rpartition("-") if "-" in words.split(" ")[-1] else words.rpartition(" ")
    if last in _EN_ORDINAL_WORDS:
        last = _EN_ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def _en_year(year: int) -> str:
    """1984 -> nineteen eighty-four, 2005 -> two thousand five, 2024 -> twenty twenty-four."""
    if 1100 <= year <= 9999 and not (2000 <= year <= 2009) and year % 1000 >= 10:
        high, low = divmod(year, 100)
        return f"{en_cardinal(high)} {'hundred' if low == 0 else ('oh ' + _EN_ONES[low] if low < 10 else en_cardinal(low))}"
    return en_cardinal(year)


# -- Mandarin ------------------------------------------------------------------------------------------
_ZH_DIGITS = "零一二三四五六七八九"
_ZH_UNITS = ("", "十", "百", "千")
_ZH_GROUPS = ("", "万", "亿", "万亿")


def _zh_below_10000(n: int) -> str:
    out, zero = "", False
    for position in range(3, -1, -1):
        digit = n // 10**position % 10
        if digit == 0:
            zero = bool(out)
            continue
        if zero:
            out += "零"
            zero = False
        out += _ZH_DIGITS[digit] + _ZH_UNITS[position]
    return out


def zh_cardinal(n: int) -> str:
    if n < 0:
        return "负" + zh_cardinal(-n)
    if n == 0:
        return "零"
    groups = []
    while n:
        n, group = divmod(n, 10000)
        groups.append(group)
    out, zero = "", False
    for index in range(len(groups) - 1, -1, -1):
        group = groups[index]
        if group == 0:
            zero = bool(out)
            continue
        if out and (zero or group < 1000):
            out += "零"
        out += _zh_below_10000(group) + _ZH_GROUPS[index]
        zero = False
    if out.startswith("一十"):  # 10-19 are read 十, 十一 ... (not 一十一) at the head of a number
        out = out[1:]
    return out


# -- shared readings -----------------------------------------------------------------------------------
def cardinal(text: str, lang: Lang) -> str:
    value = text.strip().replace(",", "").replace("，", "")
    match = re.fullmatch(r"([+-]?)(\d+)(?:\.(\d+))?", value)
    if not match or int(match[2]) > MAX_NUMBER:
        raise SayAsError(f"say-as cardinal: {text.strip()[:40]!r} is not a number up to {MAX_NUMBER}")
    n = int(match[2]) * (-1 if match[1] == "-" else 1)
    whole = en_cardinal(n) if lang == "en" else zh_cardinal(n)
    if n == 0 and match[1] == "-":
        whole = ("minus " if lang == "en" else "负") + whole
    if match[3] is None:
        return whole
    fraction = digits(match[3], lang)
    return f"{whole} point {fraction}" if lang == "en" else f"{whole}点{fraction}"


def ordinal(text: str, lang: Lang) -> str:
    value = re.sub(r"(st|nd|rd|th|\.)$", "", text.strip().replace(",", ""), flags=re.I)
    if not value.isdigit() or int(value) > MAX_NUMBER:
        raise SayAsError(f"say-as ordinal: {text.strip()[:40]!r} is not a whole number")
    return en_ordinal(int(value)) if lang == "en" else "第" + zh_cardinal(int(value))


def digits(text: str, lang: Lang) -> str:
    found = [c for c in text if c.isdigit()]
    if not found:
        raise SayAsError(f"say-as digits: {text.strip()[:40]!r} has no digits")
    return " ".join(_EN_ONES[int(c)] for c in found) if lang == "en" else "".join(_ZH_DIGITS[int(c)] for c in found)


def characters(text: str, lang: Lang) -> str:
    spelled = []
    for c in text.strip():
        if c.isspace():
            continue
        if c.isdigit() and c.isascii():
            spelled.append(_EN_ONES[int(c)] if lang == "en" else _ZH_DIGITS[int(c)])
        else:
            spelled.append(c.upper() if lang == "en" else c)
    if not spelled:
        raise SayAsError("say-as characters: nothing to spell")
    return " ".join(spelled)


def _phone_groups(number: str) -> list[str]:
    """The written groups (+1 (555) 123-4567 -> 1, 555, 123, 4567); an unbroken run is cut the way it is
    usually said: 11 digits (a Chinese mobile) 3-4-4, 10 digits 3-3-4, 7 digits 3-4, else fours."""
    groups = re.findall(r"\d+", number)
    if len(groups) != 1:
        return groups
    run = groups[0]
    cuts = {11: (3, 4, 4), 10: (3, 3, 4), 7: (3, 4)}.get(len(run))
    if cuts is None:
        return [run[i:i + 4] for i in range(0, len(run), 4)]
    out, start = [], 0
    for size in cuts:
        out.append(run[start:start + size])
        start += size
    return out


def telephone(text: str, lang: Lang) -> str:
    if not re.fullmatch(r"[\d\s()+\-.]+", text.strip()) or not re.search(r"\d", text):
        raise SayAsError(f"say-as telephone: {text.strip()[:40]!r} is not a telephone number")
    groups = _phone_groups(text)
    plus = text.strip().startswith("+")
    if lang == "en":
        spoken = ", ".join(" ".join(_EN_ONES[int(c)] for c in group) for group in groups)
        return ("plus " if plus else "") + spoken
    # Mandarin reads 1 as 幺 in numbers said digit by digit, so it is not heard as 七.
    spoken = "，".join("".join("幺" if c == "1" else _ZH_DIGITS[int(c)] for c in group) for group in groups)
    return ("加" if plus else "") + spoken


_DATE_FIELDS = {"mdy": "mdy", "dmy": "dmy", "ymd": "ymd", "md": "md", "dm": "dm", "ym": "ym", "my": "my",
                "y": "y", "m": "m", "d": "d"}


def date(text: str, lang: Lang, format: str | None) -> str:
    order = (format or "ymd").lower()
    if order not in _DATE_FIELDS:
        raise SayAsError(f"say-as date: format {format!r}; choose one of {', '.join(_DATE_FIELDS)}")
    parts = re.findall(r"\d+", text)
    if len(parts) != len(order) or len(parts) == 0:
        raise SayAsError(f"say-as date: {text.strip()[:40]!r} does not match format {order!r}")
    values = dict(zip(order, (int(p) for p in parts)))
    year, month, day = values.get("y"), values.get("m"), values.get("d")
    if month is not None and not 1 <= month <= 12 or day is not None and not 1 <= day <= 31:
        raise SayAsError(f"say-as date: {text.strip()[:40]!r} has no such month or day for format {order!r}")
    if lang == "en":
        words = []
        if month is not None:
            words.append(_EN_MONTHS[month - 1])
        if day is not None:
            words.append(en_ordinal(day) if month is not None else f"the {en_ordinal(day)}")
        out = " ".join(words)
        if year is not None:
            out = f"{out}, {_en_year(year)}" if day is not None else f"{out} {_en_year(year)}".strip()
        return out
    out = ""
    if year is not None:
        out += "".join(_ZH_DIGITS[int(c)] for c in str(year)) + "年"
    if month is not None:
        out += zh_cardinal(month) + "月"
    if day is not None:
        out += zh_cardinal(day) + "日"
    return out


def time(text: str, lang: Lang) -> str:
    match = re.fullmatch(r"\s*(\d{1,2}):(\d{2})(?::(\d{2}))?\s*([AaPp][Mm])?\s*", text)
    if not match:
        raise SayAsError(f"say-as time: {text.strip()[:40]!r} is not hh:mm[:ss] [am|pm]")
    hour, minute = int(match[1]), int(match[2])
    second = int(match[3]) if match[3] else 0
    meridiem = match[4].lower() if match[4] else None
    if hour > 23 or minute > 59 or second > 59 or (meridiem and not 1 <= hour <= 12):
        raise SayAsError(f"say-as time: {text.strip()[:40]!r} is no time of day")
    if meridiem == "pm" and hour != 12:
        hour += 12
    elif meridiem == "am" and hour == 12:
        hour = 0
    if lang == "zh":
        out = ("两" if hour == 2 else zh_cardinal(hour)) + "点"
        out += f"{zh_cardinal(minute) if minute >= 10 else '零' + zh_cardinal(minute)}分" if minute else "整"
        return out + (f"{zh_cardinal(second)}秒" if second else "")
    twelve = hour % 12 or 12
    out = en_cardinal(twelve)
    out += " o'clock" if minute == 0 else (f" oh {_EN_ONES[minute]}" if minute < 10 else f" {en_cardinal(minute)}")
    if second:
        out += f" and {en_cardinal(second)} second{'s' if second != 1 else ''}"
    return out + (" PM" if hour >= 12 else " AM")


# Currency: code -> (symbols, en major/minor singular and plural, zh major, zh minor)
_CURRENCIES = {
    "USD": (("$", "US$"), ("dollar", "dollars", "cent", "cents"), "美元", "美分"),
    "EUR": (("€",), ("euro", "euros", "cent", "cents"), "欧元", "欧分"),
    "GBP": (("£",), ("pound", "pounds", "penny", "pence"), "英镑", "便士"),
    "CNY": (("¥", "￥", "RMB"), ("yuan", "yuan", "fen", "fen"), "元", None),
    "JPY": (("JP¥", "円"), ("yen", "yen", "sen", "sen"), "日元", None),
}
_SYMBOLS = {symbol: code for code, (symbols, *_) in _CURRENCIES.items() for symbol in symbols}


def currency(text: str, lang: Lang) -> str:
    value = text.strip().replace(",", "")
    match = re.fullmatch(r"([A-Za-z]{3}|[^\d\s.+-]{1,3})?\s*(-)?(\d+)(?:\.(\d{1,2}))?\s*([A-Za-z]{3})?", value)
    if not match or not (match[1] or match[5]):
        raise SayAsError(f"say-as currency: {text.strip()[:40]!r} needs an amount and a currency ($, €, £, ¥ "
                         f"or {', '.join(_CURRENCIES)})")
    mark = match[1] or match[5]
    mark = mark.upper() if mark.isascii() else mark
    code = mark if mark in _CURRENCIES else _SYMBOLS.get(mark)
    if code is None:
        raise SayAsError(f"say-as currency: unknown currency {mark!r}; known: {', '.join(_CURRENCIES)}")
    major, minor = int(match[3]), int((match[4] or "0").ljust(2, "0"))
    _, (one, many, cent, cents), zh_major, zh_minor = _CURRENCIES[code]
    negative = match[2] == "-"
    if lang == "en":
        out = f"{en_cardinal(major)} {one if major == 1 else many}"
        if minor:
            out += f" and {en_cardinal(minor)} {cent if minor == 1 else cents}"
        return ("minus " if negative else "") + out
    out = zh_cardinal(major) + zh_major
    if minor and code == "CNY":  # 元, 角 (tenths), 分 (hundredths)
        jiao, fen = divmod(minor, 10)
        out += (zh_cardinal(jiao) + "角" if jiao else "零") + (zh_cardinal(fen) + "分" if fen else "")
    elif minor and zh_minor:
        out += zh_cardinal(minor) + zh_minor
    elif minor:
        out = zh_cardinal(major) + "点" + digits(match[4], "zh") + zh_major
    return ("负" if negative else "") + out


READERS: dict[str, Callable[..., str]] = {
    "cardinal": cardinal, "number": cardinal, "ordinal": ordinal, "digits": digits, "characters": characters,
    "spell-out": characters, "telephone": telephone, "time": time, "currency": currency,
}


def say_as(text: str, interpret_as: str, lang: Lang, format: str | None = None) -> str | None:
    """The words for `text` read as `interpret_as`; None for an interpret-as we do not know (the caller
    speaks the text as it is, as for any unknown markup)."""
    kind = interpret_as.strip().lower()
    if kind == "date":
        return date(text, lang, format)
    reader = READERS.get(kind)
    return None if reader is None else reader(text, lang)

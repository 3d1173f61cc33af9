"""SSML, once for every way in: the SIP header and routes, configured prompts and the speech API all parse here.

`parse_ssml` (parse.py) turns a document into `Speech`/`Pause` segments (segments.py), `say_as.py` reads
numbers, dates and money in words. Pure: no I/O, no engine; engines/segmented.py speaks the segments.
"""

from engines.ssml.parse import AudioResolver, SsmlError, is_ssml, parse_ssml
from engines.ssml.segments import Pause, Segment, Speech, spoken_text

__all__ = ["AudioResolver", "Pause", "Segment", "Speech", "SsmlError", "is_ssml", "parse_ssml", "spoken_text"]

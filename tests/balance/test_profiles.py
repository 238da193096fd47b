"""Reading lengths: a bad lengths or profile file is named with its line or item and the value."""

from __future__ import annotations

import json
import re

import pytest

from megatron_odc.balance.profiles import load_lengths_file, load_profile_lengths


def test_unparsable_json_names_the_file_and_its_line(tmp_path) -> None:
    lengths = tmp_path / "len.json"
    lengths.write_text("[1,2,\n")
    with pytest.raises(
        ValueError, match=re.escape(f"{lengths}:2: not valid JSON (Expecting value")
    ):
        load_lengths_file(lengths)
    profiles = tmp_path / "profiles.json"
    profiles.write_text('{"tiny": {"lengths": [1]}}\n}')
    with pytest.raises(ValueError, match=re.escape(f"{profiles}:2: not valid JSON (Extra data")):
        load_profile_lengths("tiny", profiles)


def test_a_bad_length_is_named_by_its_position_or_line(tmp_path) -> None:
    as_json = tmp_path / "neg.json"
    as_json.write_text("[5, -3, 7]")
    with pytest.raises(ValueError, match=re.escape(f"{as_json}: item 2: length -3 is not allowed")):
        load_lengths_file(as_json)
    text = tmp_path / "neg.txt"
    text.write_text("5\n\n-3\n7\n")  # the blank line counts for the line number
    with pytest.raises(ValueError, match=re.escape(f"{text}:3: length -3 is not allowed")):
        load_lengths_file(text)
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"tiny": {"lengths": [1, 2, 3.5]}}))
    with pytest.raises(
        ValueError, match=re.escape(f"{profiles}: profile 'tiny': item 3: length 3.5")
    ):
        load_profile_lengths("tiny", profiles)

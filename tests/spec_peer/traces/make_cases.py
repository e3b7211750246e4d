"""Writes valid/, invalid/ and ambiguous/ cases.  Stdlib only."""
import json
import os
import shutil

import trace_indep as T

HERE = os.path.dirname(os.path.abspath(__file__))
H = '{"format": "kvbridge-trace", "version": 1, "vocab_size": 128256}'
R = '{"request_id": "r1", "session_id": "s", "arrival_s": 0.0, "output_tokens": 1, "segments": [{"tokens": [1]}]}'


def req(rid="r1", sid="s", arr=0.0, out=1, segs=None, **extra):
    d = {"request_id": rid, "session_id": sid, "arrival_s": arr,
         "output_tokens": out, "segments": segs if segs is not None else [{"tokens": [1]}]}
    d.update(extra)
    return json.dumps(d, ensure_ascii=False)


def hdr(vocab=128256, **extra):
    d = {"format": "kvbridge-trace", "version": 1, "vocab_size": vocab}
    d.update(extra)
    return json.dumps(d, ensure_ascii=False)


def reset(d):
    p = os.path.join(HERE, d)
    shutil.rmtree(p, ignore_errors=True)
    os.makedirs(p)
    return p


def write_raw(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def jdump(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


# ------------------------------------------------------------------ valid
VALID = {
    "01_minimal.jsonl": H + "\n" + R + "\n",
    "02_minimal_no_trailing_newline.jsonl": H + "\n" + R,
    "03_header_all_optional.jsonl":
        hdr(name="agent-seed0", meta={"seed": 0, "nested": {"a": [1, 2.5, None, True]}, "s": "x"}) + "\n"
        + req(segs=[{"gen": [8121, 4096]}, {"tokens": [128000, 9906, 1917]}, {"gen": [77, 300]}], out=42, arr=3.25) + "\n",
    "04_header_name_only_empty_meta.jsonl": hdr(name="", meta={}) + "\n" + R + "\n",
    "05_blank_lines_between.jsonl":
        H + "\n\n" + req("a") + "\n\n\n" + req("b", arr=1) + "\n\n",
    "06_mixed_segments.jsonl": H + "\n" + "\n".join([
        req("m1", "s0", 0.0, 5, [{"gen": [1, 10]}, {"tokens": [0, 128255]}, {"gen": [1, 10]}]),
        req("m2", "s0", 0.5, 0, [{"gen": [1, 10]}, {"tokens": [0, 128255]}, {"gen": [1, 10]}, {"tokens": [7]}, {"gen": [2, 3]}]),
        req("m3", "s1", 0.75, 3, [{"tokens": [5]}, {"tokens": [6]}, {"tokens": [7, 8, 9]}]),
    ]) + "\n",
    "07_seed_bounds.jsonl": H + "\n" + "\n".join([
        req("z", segs=[{"gen": [0, 16]}]),
        req("max", segs=[{"gen": [2 ** 64 - 1, 16]}]),
        req("both", segs=[{"gen": [0, 1]}, {"gen": [2 ** 64 - 1, 1]}]),
    ]) + "\n",
    "08_token_bounds.jsonl": hdr(1000) + "\n" + req(segs=[{"tokens": [0, 999, 0, 999]}]) + "\n",
    "09_vocab_min.jsonl": hdr(2) + "\n" + req("a", segs=[{"tokens": [0, 1, 1, 0]}]) + "\n"
        + req("b", segs=[{"gen": [12345, 40]}]) + "\n",
    "10_vocab_max.jsonl": hdr(2 ** 31) + "\n" + req("a", segs=[{"tokens": [0, 2 ** 31 - 1]}, {"gen": [0, 8]}]) + "\n",
    "11_equal_arrivals.jsonl": H + "\n" + "\n".join([
        req("a", arr=1.5), req("b", arr=1.5), req("c", arr=1.5), req("d", arr=2)]) + "\n",
    "12_output_tokens_zero_and_int_arrival.jsonl": H + "\n" + "\n".join([
        req("a", arr=0, out=0), req("b", arr=7, out=0), req("c", arr=7.0, out=1000000)]) + "\n",
    "13_unicode_ids.jsonl": H + "\n" + "\n".join([
        req("日本語-🙂", "séssion-Ω"),
        req("\u00e9", "\u00e9"),
        req("e\u0301", "\u00e9"),          # NFD form: a different string from "é"
        req("tab\there", "t"),
    ]) + "\n" + '{"request_id": "\\u0440\\u0443\\ud83d\\ude00", "session_id": "x", "arrival_s": 0.0, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n',
    "14_prompt_at_max.jsonl": H + "\n" + req("big", segs=[{"gen": [42, 2 ** 22 - 3]}, {"tokens": [1, 2, 3]}]) + "\n",
    "15_prompt_at_max_by_many_segments.jsonl": H + "\n"
        + req("big", segs=[{"gen": [9, 2 ** 20]}] * 4) + "\n"
        + req("big2", segs=[{"gen": [9, 2 ** 21]}, {"gen": [9, 2 ** 21]}]) + "\n",
    "16_key_order_shuffled.jsonl":
        '{"vocab_size": 50, "meta": {"x": 1}, "name": "n", "version": 1, "format": "kvbridge-trace"}\n'
        '{"segments": [{"gen": [3, 5]}], "output_tokens": 2, "arrival_s": 1e-3, "session_id": "s", "request_id": "r"}\n',
    "17_json_whitespace_and_escapes.jsonl":
        '  {  "format" :"kvbridge-trace","version":1 ,"vocab_size":\t300}  \n'
        '{"request_id":"\\"q\\"\\\\/","session_id":"\\n","arrival_s":2.5E+1,"output_tokens":0,"segments":[ {"tokens":[ 299 ]} ]}\n',
    "18_header_meta_with_unknown_looking_keys.jsonl":
        hdr(meta={"request_id": "not a request", "vocab_size": -1, "deep": [[[{}]]]}) + "\n" + R + "\n",
    "19_big_arrival_values.jsonl": H + "\n" + req("a", arr=0.1) + "\n" + req("b", arr=1e300) + "\n"
        + '{"request_id": "c", "session_id": "s", "arrival_s": 100000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000001, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n',
    "20_shared_prefix_session.jsonl": hdr(128256, name="spec-example") + "\n"
        + req("s0-t0", "s0", 0.0, 42, [{"gen": [8121, 4096]}, {"gen": [5, 20]}]) + "\n"
        + req("s0-t1", "s0", 3.25, 42, [{"gen": [8121, 4096]}, {"tokens": [128000, 9906, 1917]}, {"gen": [77, 300]}]) + "\n"
        + req("s1-t0", "s1", 3.25, 7, [{"gen": [8121, 4096]}]) + "\n",
}

# ------------------------------------------------------------------ invalid
# (name, data, line, rule quote)
RULE_LINE9 = "The file is UTF-8 with one JSON object per line. Blank lines are skipped. (l.9) / The problems it catches: not JSON (l.62-63)"
INVALID = [
    ("empty_file", "", 0, "0 means a whole-file problem such as an empty file (l.61-62)"),
    ("only_blank_lines", "\n\n\n", 0, "0 means a whole-file problem such as an empty file (l.61-62); Line 1 is the header (l.11)"),
    ("not_json_header", "{format: kvbridge-trace}\n" + R + "\n", 1, "not JSON (l.62)"),
    ("not_json_request", H + "\n" + R[:-1] + "\n", 2, "not JSON (l.62)"),
    ("two_objects_one_line", H + "\n" + R + " " + R + "\n", 2, "one JSON object per line (l.9); not JSON (l.62)"),
    ("header_not_object", '["kvbridge-trace", 1, 128256]\n' + R + "\n", 1, "not an object (l.62)"),
    ("request_not_object", H + "\n" + R + "\n" + '"r2"\n', 3, "not an object (l.62)"),
    ("request_null", H + "\n" + "null\n", 2, "not an object (l.62)"),
    ("header_is_request", R + "\n" + R.replace('"r1"', '"r2"') + "\n", 1, "Line 1 is the header (l.11); a wrong header (l.63)"),
    ("wrong_format", H.replace("kvbridge-trace", "kvbridge-trace2") + "\n" + R + "\n", 1, "`format` | string | exactly \"kvbridge-trace\" (l.19)"),
    ("format_case", H.replace("kvbridge-trace", "KVBridge-Trace") + "\n" + R + "\n", 1, "`format` | string | exactly \"kvbridge-trace\" (l.19)"),
    ("wrong_version", H.replace('"version": 1', '"version": 2') + "\n" + R + "\n", 1, "`version` | int | `1` (l.20); a wrong header or version (l.63)"),
    ("version_string", H.replace('"version": 1', '"version": "1"') + "\n" + R + "\n", 1, "`version` | int | `1` (l.20)"),
    ("version_bool", H.replace('"version": 1', '"version": true') + "\n" + R + "\n", 1, "`version` | int | `1` (l.20)"),
    ("header_missing_vocab", '{"format": "kvbridge-trace", "version": 1}\n' + R + "\n", 1, "missing or unknown keys (l.63); `vocab_size` (l.21)"),
    ("header_missing_format", '{"version": 1, "vocab_size": 10}\n' + R + "\n", 1, "missing or unknown keys (l.63)"),
    ("header_missing_version", '{"format": "kvbridge-trace", "vocab_size": 10}\n' + R + "\n", 1, "missing or unknown keys (l.63)"),
    ("header_unknown_key", hdr(nmae="typo") + "\n" + R + "\n", 1, "Unknown keys are an error, so that typos fail (l.56-57)"),
    ("vocab_too_small", hdr(1) + "\n" + req(segs=[{"tokens": [0]}]) + "\n", 1, "`vocab_size` | int | 2 .. 2^31 (l.21)"),
    ("vocab_too_big", hdr(2 ** 31 + 1) + "\n" + R + "\n", 1, "`vocab_size` | int | 2 .. 2^31 (l.21)"),
    ("vocab_float", hdr(128256.5) + "\n" + R + "\n", 1, "`vocab_size` | int (l.21); wrong types (l.63)"),
    ("vocab_string", hdr("128256") + "\n" + R + "\n", 1, "`vocab_size` | int (l.21); wrong types (l.63)"),
    ("name_not_string", hdr(name=5) + "\n" + R + "\n", 1, "`name` | string | optional (l.22)"),
    ("meta_not_object", hdr(meta=[1, 2]) + "\n" + R + "\n", 1, "`meta` | object | optional (l.23)"),
    ("request_missing_session_id", H + "\n" + '{"request_id": "r1", "arrival_s": 0.0, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n', 2, "missing or unknown keys (l.63)"),
    ("request_missing_segments", H + "\n" + R + "\n" + '{"request_id": "r2", "session_id": "s", "arrival_s": 0.0, "output_tokens": 1}\n', 3, "missing or unknown keys (l.63)"),
    ("request_missing_output_tokens", H + "\n" + '{"request_id": "r1", "session_id": "s", "arrival_s": 0.0, "segments": [{"tokens": [1]}]}\n', 2, "missing or unknown keys (l.63)"),
    ("request_unknown_key", H + "\n" + req(prompt="hi") + "\n", 2, "Unknown keys are an error (l.56-57)"),
    ("segment_unknown_key", H + "\n" + req(segs=[{"tokens": [1], "note": "x"}]) + "\n", 2, "A segment is exactly one of (l.40); Unknown keys are an error (l.56)"),
    ("segment_other_key_only", H + "\n" + req(segs=[{"text": "hello"}]) + "\n", 2, "A segment is exactly one of (l.40)"),
    ("segment_both_keys", H + "\n" + req(segs=[{"tokens": [1], "gen": [1, 1]}]) + "\n", 2, "A segment is exactly one of (l.40)"),
    ("segment_neither_key", H + "\n" + req(segs=[{}]) + "\n", 2, "A segment is exactly one of (l.40)"),
    ("segment_not_object", H + "\n" + req(segs=[[1, 2]]) + "\n", 2, "A segment is exactly one of `{\"tokens\": ...}` / `{\"gen\": ...}` (l.40-44)"),
    ("segments_empty", H + "\n" + req(segs=[]) + "\n", 2, "`segments` | list | non-empty (l.38)"),
    ("segments_not_list", H + "\n" + req(segs={"tokens": [1]}) + "\n", 2, "`segments` | list (l.38)"),
    ("tokens_empty", H + "\n" + req(segs=[{"tokens": []}]) + "\n", 2, "literal token ids ... at least one (l.42-43)"),
    ("token_eq_vocab", hdr(1000) + "\n" + req(segs=[{"tokens": [0, 1000]}]) + "\n", 2, "a token id >= `vocab_size` (l.64); ints in `[0, vocab_size)` (l.42)"),
    ("token_negative", H + "\n" + req(segs=[{"tokens": [-1]}]) + "\n", 2, "ints in `[0, vocab_size)` (l.42)"),
    ("token_bool", H + "\n" + req(segs=[{"tokens": [1, True]}]) + "\n", 2, "ints in `[0, vocab_size)` (l.42); wrong types (l.63)"),
    ("token_float", H + "\n" + req(segs=[{"tokens": [1, 2.5]}]) + "\n", 2, "ints in `[0, vocab_size)` (l.42); wrong types (l.63)"),
    ("token_string", H + "\n" + req(segs=[{"tokens": ["1"]}]) + "\n", 2, "ints in `[0, vocab_size)` (l.42)"),
    ("tokens_not_list", H + "\n" + req(segs=[{"tokens": 5}]) + "\n", 2, "`{\"tokens\": [id, ...]}` (l.42)"),
    ("gen_length_zero", H + "\n" + req(segs=[{"gen": [1, 0]}]) + "\n", 2, "`length` (>= 1) (l.44)"),
    ("gen_length_negative", H + "\n" + req(segs=[{"gen": [1, -5]}]) + "\n", 2, "`length` (>= 1) (l.44)"),
    ("gen_seed_2pow64", H + "\n" + req(segs=[{"gen": [2 ** 64, 1]}]) + "\n", 2, "`seed` is an int in `[0, 2^64)` (l.44-45)"),
    ("gen_seed_negative", H + "\n" + req(segs=[{"gen": [-1, 1]}]) + "\n", 2, "`seed` is an int in `[0, 2^64)` (l.44-45)"),
    ("gen_seed_float", H + "\n" + req(segs=[{"gen": [1.5, 3]}]) + "\n", 2, "`seed` is an int (l.44-45)"),
    ("gen_seed_bool", H + "\n" + req(segs=[{"gen": [True, 3]}]) + "\n", 2, "`seed` is an int (l.44-45)"),
    ("gen_length_string", H + "\n" + req(segs=[{"gen": [1, "3"]}]) + "\n", 2, "`{\"gen\": [seed, length]}` `length` (>= 1) (l.44)"),
    ("gen_one_element", H + "\n" + req(segs=[{"gen": [1]}]) + "\n", 2, "`{\"gen\": [seed, length]}` (l.44)"),
    ("gen_three_elements", H + "\n" + req(segs=[{"gen": [1, 2, 3]}]) + "\n", 2, "`{\"gen\": [seed, length]}` (l.44)"),
    ("gen_as_object", H + "\n" + req(segs=[{"gen": {"seed": 1, "length": 2}}]) + "\n", 2, "`{\"gen\": [seed, length]}` (l.44)"),
    ("duplicate_request_id", H + "\n" + req("a") + "\n" + req("b") + "\n" + req("a") + "\n", 4, "`request_id` | string | non-empty, unique in the file (l.34); a duplicate `request_id` (l.64)"),
    ("duplicate_request_id_after_blank", H + "\n\n" + req("a") + "\n\n" + req("a") + "\n", 5, "unique in the file (l.34); line is 1-based (l.61) [blank lines still counted]"),
    ("empty_request_id", H + "\n" + req("") + "\n", 2, "`request_id` | string | non-empty (l.34)"),
    ("request_id_int", H + "\n" + req(7) + "\n", 2, "`request_id` | string (l.34)"),
    ("session_id_null", H + "\n" + req(sid=None) + "\n", 2, "`session_id` | string (l.35)"),
    ("arrival_backwards", H + "\n" + req("a", arr=2.0) + "\n" + req("b", arr=3.0) + "\n" + req("c", arr=2.999) + "\n", 4, "never below the previous line's (l.36); an arrival going backwards (l.64-65)"),
    ("arrival_negative", H + "\n" + req(arr=-0.5) + "\n", 2, "`arrival_s` | number | finite, >= 0 (l.36)"),
    ("arrival_nan", H + "\n" + req().replace('"arrival_s": 0.0', '"arrival_s": NaN') + "\n", 2, "`arrival_s` | number | finite (l.36) [NaN is also not JSON]"),
    ("arrival_infinity", H + "\n" + req().replace('"arrival_s": 0.0', '"arrival_s": Infinity') + "\n", 2, "`arrival_s` | number | finite (l.36) [Infinity is also not JSON]"),
    ("arrival_overflow_1e999", H + "\n" + req().replace('"arrival_s": 0.0', '"arrival_s": 1e999') + "\n", 2, "`arrival_s` | number | finite (l.36) [valid JSON literal whose double value is +inf]"),
    ("arrival_string", H + "\n" + req(arr="3.25") + "\n", 2, "`arrival_s` | number (l.36)"),
    ("arrival_bool", H + "\n" + req(arr=True) + "\n", 2, "`arrival_s` | number (l.36) [JSON true is not a number]"),
    ("output_tokens_negative", H + "\n" + req(out=-1) + "\n", 2, "`output_tokens` | int | 0 .. max (l.37)"),
    ("output_tokens_float", H + "\n" + req(out=4.5) + "\n", 2, "`output_tokens` | int (l.37)"),
    ("output_tokens_bool", H + "\n" + req(out=False) + "\n", 2, "`output_tokens` | int (l.37)"),
    ("prompt_over_max_single_gen", H + "\n" + req(segs=[{"gen": [1, 2 ** 22 + 1]}]) + "\n", 2, "A prompt is at most `max_request_tokens` long (default 2^22 tokens) (l.56)"),
    ("prompt_over_max_sum", H + "\n" + req("ok", segs=[{"gen": [1, 2 ** 22]}]) + "\n" + req("bad", segs=[{"gen": [1, 2 ** 22]}, {"tokens": [5]}]) + "\n", 3, "A prompt is at most `max_request_tokens` long (default 2^22 tokens) (l.56)"),
    ("prompt_over_max_huge_gen", H + "\n" + req(segs=[{"gen": [1, 2 ** 63]}]) + "\n", 2, "A prompt is at most `max_request_tokens` long (l.56)"),
    ("prompt_over_max_int64_wrap", H + "\n" + req(segs=[{"gen": [1, 2 ** 62]}] * 4 + [{"tokens": [5]}]) + "\n", 2, "A prompt is at most `max_request_tokens` long (l.56) [sum of lengths is 2^64+1: wraps to 1 in int64/uint64]"),
    ("prompt_over_max_gen_length_2pow70", H + "\n" + req(segs=[{"gen": [1, 2 ** 70]}]) + "\n", 2, "A prompt is at most `max_request_tokens` long (l.56)"),
    ("second_header_line", H + "\n" + R + "\n" + H + "\n", 3, "Each later line is one request (l.25); missing or unknown keys (l.63)"),
    ("invalid_utf8_in_request", (H + "\n").encode() + req("r\udcff").encode("utf-8", "surrogateescape") + b"\n", 2, "The file is UTF-8 (l.9) [line number of the bad bytes assumed]"),
    ("error_after_good_lines", H + "\n" + req("a") + "\n" + req("b") + "\n\n" + req("c", segs=[{"tokens": [128256]}]) + "\n", 5, "a token id >= `vocab_size` (l.64); .line is 1-based (l.61)"),
]

# ------------------------------------------------------------------ ambiguous
# (name, data, my_assumption, line_if_invalid, why)
AMBIG = [
    ("header_only_no_requests.jsonl", H + "\n", "valid", None, "Spec never says a trace needs >= 1 request (l.25 'Each later line is one request')."),
    ("leading_blank_line.jsonl", "\n" + H + "\n" + R + "\n", "valid", None, "l.9 'Blank lines are skipped' vs l.11 'Line 1 is the header'."),
    ("whitespace_only_line.jsonl", H + "\n   \t\n" + R + "\n", "valid", None, "l.9 'Blank lines' undefined: empty only, or whitespace-only too?"),
    ("crlf_line_endings.jsonl", H + "\r\n" + R + "\r\n", "valid", None, "Line terminator not specified; CR is JSON whitespace so json parsers accept it."),
    ("utf8_bom.jsonl", "\ufeff" + H + "\n" + R + "\n", "invalid", 1, "'The file is UTF-8' - BOM not addressed."),
    ("version_1_0.jsonl", H.replace('"version": 1', '"version": 1.0') + "\n" + R + "\n", "invalid", 1, "Is 1.0 an int? JSON has one number type."),
    ("output_tokens_1e3.jsonl", H + "\n" + req(out=1).replace('"output_tokens": 1', '"output_tokens": 1e3') + "\n", "invalid", 2, "Is 1e3 an int?"),
    ("token_2_0.jsonl", H + "\n" + req().replace('"tokens": [1]', '"tokens": [2.0]') + "\n", "invalid", 2, "Is 2.0 a valid token id int?"),
    ("seed_negative_zero.jsonl", H + "\n" + req(segs=[{"gen": [0, 3]}]).replace('"gen": [0, 3]', '"gen": [-0, 3]') + "\n", "valid", None, "-0 is an integer literal with value 0."),
    ("duplicate_key_request.jsonl", H + "\n" + R[:-1] + ', "output_tokens": 2}\n', "invalid", 2, "Duplicate JSON keys not addressed; Python json keeps the last one silently."),
    ("duplicate_key_header.jsonl", H[:-1] + ', "vocab_size": 50}\n' + R + "\n", "invalid", 1, "Duplicate JSON keys not addressed."),
    ("output_tokens_above_2pow22.jsonl", H + "\n" + req(out=2 ** 22 + 1) + "\n", "invalid", 2, "'0 .. max' (l.37): max is never defined."),
    ("output_tokens_2pow22.jsonl", H + "\n" + req(out=2 ** 22) + "\n", "valid", None, "'0 .. max' (l.37): max undefined; 64K (generator max_tokens) would reject this."),
    ("output_tokens_huge.jsonl", H + "\n" + req(out=2 ** 70) + "\n", "invalid", 2, "'0 .. max' (l.37): no stated upper bound."),
    ("empty_session_id.jsonl", H + "\n" + req(sid="") + "\n", "valid", None, "session_id has no non-empty rule (l.35), unlike request_id."),
    ("name_null.jsonl", hdr(name=None) + "\n" + R + "\n", "invalid", 1, "optional: may it be null?"),
    ("meta_null.jsonl", hdr(meta=None) + "\n" + R + "\n", "invalid", 1, "optional: may it be null?"),
    ("meta_contains_nan.jsonl", H[:-1] + ', "meta": {"x": NaN}}\n' + R + "\n", "invalid", 1, "'free-form' meta vs strict JSON; NaN is not JSON."),
    ("line_separator_in_id.jsonl", H + "\n" + req("a\u2028b") + "\n" + req("c\u0085d") + "\n", "valid", None, "Raw U+2028/U+0085 are legal inside JSON strings, but str.splitlines() treats them as line breaks."),
    ("lone_surrogate_escape_id.jsonl", H + "\n" + '{"request_id": "\\ud800", "session_id": "s", "arrival_s": 0.0, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n', "valid", None, "Escaped lone surrogate: valid JSON syntax, not a Unicode scalar value."),
    ("arrival_negative_zero.jsonl", H + "\n" + req(arr=-0.0) + "\n", "valid", None, "-0.0 >= 0 is true in IEEE; 'never below'."),
    ("header_version_before_format_bad_both.jsonl", '{"format": "x", "version": 2, "vocab_size": 1, "zz": 0}\n' + R + "\n", "invalid", 1, "Several errors on one line: which message? (line is the same)."),
    ("seed_near_2pow53.jsonl", H + "\n" + req(segs=[{"gen": [2 ** 53 + 1, 4]}]) + "\n", "valid", None, "Seeds above 2^53 lose precision in double-based JSON parsers (RFC 8259 s.6)."),
    ("arrival_int_vs_double_tie.jsonl", H + "\n" + req("a", arr=1e300) + "\n" + '{"request_id": "b", "session_id": "s", "arrival_s": ' + str(10 ** 300) + ', "output_tokens": 1, "segments": [{"tokens": [1]}]}\n', "valid", None, "Exact int 10^300 is below the double 1e300 (exact compare rejects), but equal after conversion to double."),
    ("arrival_int_too_big_for_double.jsonl", H + "\n" + req(arr=10 ** 400) + "\n", "invalid", 2, "Integer literal 10^400 is finite as an exact number but overflows a double ('finite', l.36)."),
    ("request_id_whitespace_only.jsonl", H + "\n" + req(" ") + "\n" + req("  ") + "\n", "valid", None, "'non-empty' (l.34): a space is non-empty; uniqueness by exact string."),
    ("arrival_equal_after_rounding.jsonl", H + "\n" + '{"request_id": "a", "session_id": "s", "arrival_s": 0.30000000000000001, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n' + '{"request_id": "b", "session_id": "s", "arrival_s": 0.3, "output_tokens": 1, "segments": [{"tokens": [1]}]}\n', "valid", None, "Comparison on doubles vs exact decimals ('never below' l.36)."),
]


def main():
    vdir, idir, adir = reset("valid"), reset("invalid"), reset("ambiguous")
    for name, data in VALID.items():
        p = os.path.join(vdir, name)
        write_raw(p, data)
        jdump(p + ".expect.json", T.summarize(T.load_jsonl(p)))
    names = set()
    for i, (name, data, line, rule) in enumerate(INVALID, 1):
        fn = f"{i:02d}_{name}.jsonl"
        assert name not in names, name
        names.add(name)
        p = os.path.join(idir, fn)
        write_raw(p, data)
        jdump(p + ".expect.json", {"line": line, "rule": rule})
    for name, data, verdict, line, why in AMBIG:
        p = os.path.join(adir, name)
        write_raw(p, data)
        jdump(p + ".expect.json", {"my_assumption": verdict, "line": line, "why": why})
    print(len(VALID), "valid,", len(INVALID), "invalid,", len(AMBIG), "ambiguous")


if __name__ == "__main__":
    main()

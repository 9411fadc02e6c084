"""Math (math-verify), exact-match and format rewards on hand-checked batches."""

from __future__ import annotations

import threading

import pytest

from raylign.rollout.rewards import ExactMatchReward, FormatReward, MathReward, RewardError
from raylign.rollout.rewards.builtin import extract_math_answer, last_boxed_content


def test_last_boxed_content_takes_the_last_box_with_nested_braces():
    assert last_boxed_content("first \\boxed{3}, then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed_content("no box") is None
    assert last_boxed_content("cut off \\boxed{\\frac{1}{2") is None


def test_extract_prefers_box_over_later_numbers():
    assert extract_math_answer("\\boxed{12} (checked with 3 methods)") == "\\boxed{12}"


def test_a_box_cut_off_before_it_closes_is_no_answer_not_the_last_digit_inside_it():
    assert extract_math_answer("so the answer is \\boxed{\\frac{1}{2") is None
    assert MathReward().score(["q"], ["so the answer is \\boxed{\\frac{1}{2"], ["2"]).rewards == [0.0]


def test_an_unboxed_latex_answer_is_read_as_the_expression_not_its_last_digits():
    # The values by hand: 1/2, sqrt(2), x = -1/3 and 3 * 10^2 = 300; never the digit the LaTeX ends with.
    responses = [
        "So the probability is $\\frac{1}{2}$.",
        "So the probability is $\\frac{1}{2}$.",
        "The side length is $\\sqrt{2}$.",
        "Hence $x = -\\frac{1}{3}$.",
        "Hence $x = -\\frac{1}{3}$.",
        "The total is $3 \\cdot 10^{2}$.",
        "The total is $3 \\cdot 10^{2}$.",
    ]
    labels = ["2", "1/2", "2", "3", "-1/3", "2", "300"]
    result = MathReward().score([f"q{i}" for i in range(7)], responses, labels)
    assert result.rewards == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert result.metrics["answer_found"] == [1.0] * 7


def test_math_reward_hand_checked_batch():
    responses = [
        "So the result is \\boxed{42}.",
        "So the result is \\boxed{41}.",
        "Half of one is 1/2",
        "I first guessed \\boxed{3} but it is \\boxed{5}",
        "The answer is \\boxed{\\frac{1}{2}}",
        "Adding them gives 1,000.",
        "I do not know.",
    ]
    labels = ["42", "42", "0.5", "5", "0.5", 1000, "7"]
    result = MathReward().score([f"q{i}" for i in range(7)], responses, labels)
    assert result.rewards == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert result.metrics["answer_found"] == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_a_latex_label_without_dollar_signs_is_read_whole_not_as_its_leading_number():
    # By hand: 2*sqrt(3) != 2, 4*pi != 4, 2^10 = 1024 != 2, the solutions {-2, 1} != 1, the pair {1, 2} != 1.2.
    labels = ["2\\sqrt{3}", "4\\pi", "2^{10}", "-2, 1", "1,2"]
    right = ["\\boxed{2\\sqrt{3}}", "\\boxed{4\\pi}", "\\boxed{1024}", "\\boxed{-2, 1}", "\\boxed{1,2}"]
    leading_number = ["\\boxed{2}", "\\boxed{4}", "\\boxed{2}", "\\boxed{1}", "\\boxed{1.2}"]
    prompts = [f"q{i}" for i in range(5)]
    assert MathReward().score(prompts, right, labels).rewards == [1.0] * 5
    assert MathReward().score(prompts, leading_number, labels).rewards == [0.0] * 5


def test_a_label_with_an_escaped_dollar_sign_is_an_amount_not_an_unreadable_label():
    # "\$18.90" is LaTeX for the amount $18.90 (as MATH writes money answers), not a "$" math delimiter.
    responses = ["So it costs \\boxed{\\$18.90}.", "So it costs \\boxed{18.90}.", "So it costs \\boxed{19}."]
    assert MathReward().score(["q"] * 3, responses, ["\\$18.90"] * 3).rewards == [1.0, 1.0, 0.0]


def test_a_box_with_a_space_before_its_brace_is_the_answer():
    # LaTeX reads "\boxed {5}" as "\boxed{5}": the answer is 5, after the 7 the working ended on.
    responses = ["7 - 2 gives \\boxed {5}", "7 - 2 gives \\fbox  {5}", "so 7 \\boxed {5"]
    result = MathReward().score(["q"] * 3, responses, ["5"] * 3)
    assert result.rewards == [1.0, 1.0, 0.0]
    assert result.metrics["answer_found"] == [1.0, 1.0, 0.0]


def test_math_reward_works_off_the_main_thread():
    # math-verify's own timeouts use SIGALRM, which only the main thread may set.
    out = {}

    def run():
        out["result"] = MathReward().score(["q", "q"], ["\\boxed{1/2}", "\\boxed{3}"], ["0.5", "4"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert out["result"].rewards == [1.0, 0.0]


def test_math_reward_unparseable_or_missing_label_names_the_sample():
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'second question'\).*cannot parse the label"):
        MathReward().score(["first", "second question"], ["\\boxed{1}", "\\boxed{2}"], ["1", "\\frac{"])
    with pytest.raises(RewardError, match=r"sample 0 \(prompt 'first'\) has no label"):
        MathReward().score(["first"], ["\\boxed{1}"], [None])


@pytest.mark.parametrize(
    ("reward", "says_nan"), [(MathReward(), "\\boxed{NaN}"), (ExactMatchReward(case_sensitive=False), "NaN")]
)
def test_a_float_nan_label_is_missing_not_the_symbol_nan(reward, says_nan):
    # An empty cell of a pandas-written file arrives as float NaN; read as text it is "nan", which
    # math-verify parses as a symbol and a response saying "NaN" matched it for a reward of 1.0.
    assert reward.score(["q"], [says_nan], ["NaN"]).rewards == [1.0]  # the text "NaN" is a real label
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'second'\) has no label"):
        reward.score(["first", "second"], ["3", says_nan], [3, float("nan")])


@pytest.mark.parametrize(
    ("label", "problem"),
    [
        ("", "the label '' is blank (an empty cell?)"),
        ("  ", "the label '  ' is blank (an empty cell?)"),
        (True, "the label True is a bool, not an answer; write it as text"),
        (["A", "B"], "the label ['A', 'B'] is a list, not an answer; write it as text"),
        ({"answer": 2}, "the label {'answer': 2} is a dict, not an answer; write it as text"),
    ],
)
@pytest.mark.parametrize("reward", [MathReward(), ExactMatchReward()])
def test_a_blank_boolean_list_or_mapping_label_is_an_error_naming_the_sample_not_a_wrong_answer(reward, label, problem):
    # Each used to go through str(): a reward of 0 for every response, the data problem unseen.
    with pytest.raises(RewardError) as err:
        reward.score(["first", "second"], ["2", "2"], ["2", label])
    assert str(err.value) == f"{reward.description}: sample 1 (prompt 'second'): {problem}"


def test_a_float_label_counts_as_its_number_for_math_and_is_refused_where_text_is_compared():
    # A parquet column of integers with one empty cell comes back as floats: 3.0 would never equal "3".
    assert MathReward().score(["q", "q", "q"], ["\\boxed{3}", "\\boxed{0.5}", "\\boxed{4}"], [3.0, 0.5, 3]).rewards == [
        1.0,
        1.0,
        0.0,
    ]
    assert ExactMatchReward().score(["q", "q"], ["3", "4"], [3, "3"]).rewards == [1.0, 0.0]  # integers are text
    with pytest.raises(RewardError) as err:
        ExactMatchReward().score(["q"], ["3"], [3.0])
    assert str(err.value) == (
        "exact-match reward: sample 0 (prompt 'q'): the label is the number 3.0, and this reward compares text: "
        "write labels as strings (a column of integers with an empty cell is read back as floats)"
    )
    with pytest.raises(RewardError, match=r"sample 0 \(prompt 'q'\): the label inf is a float, not an answer"):
        MathReward().score(["q"], ["\\boxed{1}"], [float("inf")])


def test_exact_match_normalises_whitespace():
    prompts = ["a", "b", "c", "d"]
    responses = ["  Paris \n", "New   York", "paris", "Pari s"]
    labels = ["Paris", "New York", "Paris", "Paris"]
    assert ExactMatchReward().score(prompts, responses, labels).rewards == [1.0, 1.0, 0.0, 0.0]
    assert ExactMatchReward(case_sensitive=False).score(prompts, responses, labels).rewards == [1.0, 1.0, 1.0, 0.0]


def test_format_reward_default_think_then_answer():
    from raylign.config.reward import DEFAULT_FORMAT_REGEX

    responses = [
        "<think>2 + 2 is 4</think> The answer is 4.",
        "<think>line one\nline two</think>\n\\boxed{4}",
        "The answer is 4.",
        "<think>only thinking</think>   ",
        "<think>unclosed thinking 4",
    ]
    rewards = FormatReward(DEFAULT_FORMAT_REGEX).score(["p"] * 5, responses).rewards
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_reward_custom_regex_must_match_whole_response():
    reward = FormatReward(r"<answer>\d+</answer>")
    assert reward.score(["p"] * 3, ["<answer>12</answer>", "x <answer>12</answer>", "<answer>a</answer>"]).rewards == [
        1.0,
        0.0,
        0.0,
    ]


def test_batch_lists_of_different_lengths_are_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        ExactMatchReward().score(["a", "b"], ["a"], ["a", "b"])

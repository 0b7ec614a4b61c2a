"""spec_edge_interfaces: the service and the action carry the same request and response fields."""
from spec_edge.ros2.messages import fill_response, response_to_dict
from spec_edge.runtime.scheduler import Outcome


def test_service_and_action_share_their_fields():
    from spec_edge_interfaces.action import Generate as GenerateAction
    from spec_edge_interfaces.srv import Generate as GenerateSrv
    fields = lambda cls: cls.get_fields_and_field_types()  # noqa: E731
    assert fields(GenerateSrv.Request) == fields(GenerateAction.Goal)
    assert fields(GenerateSrv.Response) == fields(GenerateAction.Result)
    assert fields(GenerateAction.Feedback) == {"delta": "string", "num_tokens": "uint32"}


def test_optional_fields_default_to_the_node_default():
    from spec_edge.ros2.client import OPTIONAL_FIELDS, fill_request
    from spec_edge_interfaces.srv import Generate
    request = Generate.Request(prompt="hi")
    assert all(len(getattr(request, name)) == 0 for name in OPTIONAL_FIELDS)
    assert request.speculate is True and request.drafter == ""
    filled = fill_request(Generate.Request(), prompt="hi", max_new_tokens=8, temperature=0.5,
                          messages=[("user", "hi")], stop=["\n"])
    assert list(filled.max_new_tokens) == [8] and abs(filled.temperature[0] - 0.5) < 1e-6
    assert filled.messages[0].role == "user" and list(filled.stop) == ["\n"]


def test_response_round_trip():
    from spec_edge_interfaces.srv import Generate
    outcome = Outcome(success=True, text="hi", num_tokens=2, finish_reason="eos",
                      stats={"drafted": 4, "accepted": 3, "acceptance_rate": 0.75, "drafter": "ngram",
                             "k": 4, "tokens_per_s": float("nan"), "accepted_at": [1, 2],
                             "verify_calls_by_k": [0, 2, 0, 5]})
    out = response_to_dict(fill_response(Generate.Response(), outcome))
    assert out["text"] == "hi" and out["finish_reason"] == "eos" and out["success"] is True
    assert out["stats"]["drafted"] == 4 and out["stats"]["drafter"] == "ngram"
    assert out["stats"]["verify_calls_by_k"] == [0, 2, 0, 5]  # a uint32[] field, as a JSON list
    assert out["stats"]["tokens_per_s"] == 0.0  # not finite -> 0


def test_distribution_fields_round_trip():
    """The request's logit_bias pairs and flags reach the engine request; the result's logprobs the response."""
    from spec_edge.ros2.client import fill_request
    from spec_edge.ros2.messages import to_engine_request
    from spec_edge.runtime.sampling import TokenLogprobs
    from spec_edge_interfaces.srv import Generate
    msg = fill_request(Generate.Request(), prompt="hi", min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=0.25, logit_bias=[(7, -100.0), (9, 2.5)], ignore_eos=True, logprobs=3)
    request = to_engine_request(msg)
    assert request.logit_bias == ((7, -100.0), (9, 2.5)) and request.ignore_eos and request.logprobs == 3
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, 0.25)  # float32 fields
    assert abs(request.repetition_penalty - 1.2) < 1e-6 and abs(request.min_p - 0.1) < 1e-6
    assert to_engine_request(Generate.Request(prompt="hi")).min_p is None  # empty: the node's default
    entry = TokenLogprobs(5, -0.5, (5, 8), (-0.5, -1.25))
    out = response_to_dict(fill_response(Generate.Response(), Outcome(success=True, token_ids=[5], logprobs=[entry])))
    assert out["logprobs"] == [{"token_id": 5, "logprob": -0.5, "top_ids": [5, 8], "top_logprobs": [-0.5, -1.25]}]
    assert "logprobs" not in response_to_dict(fill_response(Generate.Response(), Outcome(success=True)))


def test_tool_fields_round_trip():
    """Tools, tool_choice and parallel_tool_calls reach the engine request as runtime/requests.py's types; a
    conversation's assistant calls and tool results too; the defaults are the request's (auto, parallel)."""
    from spec_edge.ros2.client import fill_request
    from spec_edge.ros2.messages import to_engine_request
    from spec_edge.runtime.requests import ChatMessage, GenerateRequest, Tool, ToolCall
    from spec_edge_interfaces.msg import Tool as ToolMsg
    from spec_edge_interfaces.srv import Generate
    default = to_engine_request(Generate.Request(prompt="hi"))
    assert (default.tools, default.tool_choice, default.parallel_tool_calls) == ((), "auto", True)
    assert Generate.Request().parallel_tool_calls is True  # the message's own default is OpenAI's
    move = Tool("move_to", "Drive to a room.",
                '{"type": "object", "properties": {"place": {"type": "string", "enum": ["kitchen"]}}}')
    call = ToolCall("call_0a1b", "move_to", '{"place": "kitchen"}')
    turns = (ChatMessage("user", "Go to the kitchen."), ChatMessage("assistant", "", (call,)),
             ChatMessage("tool", "arrived", tool_call_id="call_0a1b"))
    msg = fill_request(Generate.Request(), messages=[("system", "You drive."), *turns],
                       tools=[move, Tool("stop")], tool_choice="move_to", parallel_tool_calls=False)
    request = to_engine_request(msg)
    assert request.messages == (ChatMessage("system", "You drive."), *turns)
    assert request.tools == (move, Tool("stop", parameters=Tool.parameters))
    assert (request.tool_choice, request.parallel_tool_calls) == ("move_to", False)
    no_arguments = Generate.Request(prompt="hi", tools=[ToolMsg(name="stop")])  # parameters "" = no arguments
    assert to_engine_request(no_arguments).tools == (Tool("stop"),)
    assert GenerateRequest().tool_choice == "auto"


def test_tool_calls_in_the_response():
    from spec_edge.ros2.messages import chat_message
    from spec_edge.runtime.requests import ToolCall
    from spec_edge_interfaces.action import Generate as GenerateAction
    from spec_edge_interfaces.msg import ChatMessage
    from spec_edge_interfaces.srv import Generate
    calls = [ToolCall("call_1", "pick", '{"object": "cup"}'), ToolCall("call_2", "say", '{"text": "got it"}')]
    outcome = Outcome(success=True, text="", finish_reason="tool_calls", tool_calls=calls)
    for message in (Generate.Response(), GenerateAction.Result()):
        out = response_to_dict(fill_response(message, outcome))
        assert out["finish_reason"] == "tool_calls"
        assert out["tool_calls"] == [call.as_dict() for call in calls]
    assert response_to_dict(fill_response(Generate.Response(), Outcome(success=True)))["tool_calls"] == []
    # a result's calls go back as the assistant turn of the next request unchanged
    turn = ChatMessage(role="assistant", tool_calls=fill_response(Generate.Response(), outcome).tool_calls)
    assert chat_message(turn).tool_calls == tuple(calls)

"""spec_edge_interfaces: the service and the action carry the same request and response fields."""
from spec_edge.ros2.messages import Outcome, fill_response, response_to_dict


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

"""A corpus of 57 real-world JSON schemas, in the shapes JSONSchemaBench collects (API payloads,
configs, records, recursive documents), each with a prompt the small test models can answer.
Shared by the tests (every accepted schema is answered validly) and bench/schema_corpus.py
(coverage against other engines)."""

from __future__ import annotations

_str = {"type": "string"}
_short = {"type": "string", "maxLength": 40}
_int = {"type": "integer"}
_num = {"type": "number"}
_bool = {"type": "boolean"}


def _object(properties: dict, required: list[str] | None = None, **more) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **more}


CORPUS: dict[str, tuple[dict, str]] = {
    "person": (_object({"name": _short, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
               "A person named Ann, aged 31."),
    "person_email": (_object({"name": _short, "email": {"type": "string", "format": "email"}}),
                     "Contact details for Bob."),
    "uuid_record": (_object({"id": {"type": "string", "format": "uuid"}, "label": _short}), "A record with an id."),
    "event_date": (_object({"title": _short, "date": {"type": "string", "format": "date"}}), "An event on a date."),
    "event_datetime": (_object({"title": _short, "starts_at": {"type": "string", "format": "date-time"}}),
                       "A meeting with its start time."),
    "time_slot": (_object({"start": {"type": "string", "format": "time"}, "end": {"type": "string", "format": "time"}}),
                  "A time slot in the afternoon."),
    "url_link": (_object({"text": _short, "href": {"type": "string", "format": "uri"}}), "A link to a homepage."),
    "ipv4_host": (_object({"host": {"type": "string", "format": "hostname"}, "ip": {"type": "string", "format": "ipv4"}}),
                  "A server with its IP address."),
    "zip_pattern": (_object({"city": _short, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                    "A US city and its zip code."),
    "sku_pattern": (_object({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": _int}),
                    "A product SKU and quantity."),
    "phone_pattern": (_object({"phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"}}), "A phone number."),
    "enum_status": (_object({"status": {"enum": ["open", "closed", "pending"]}, "note": _short}),
                    "The status of a ticket."),
    "const_version": (_object({"version": {"const": 2}, "name": _short}), "A config of version 2."),
    "bool_flags": (_object({"enabled": _bool, "beta": _bool, "name": _short}), "Feature flags for a service."),
    "number_range": (_object({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {
        "enum": ["USD", "EUR"]}}), "The price of a book."),
    "exclusive_bounds": (_object({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
                         "A score out of ten."),
    "negative_ints": (_object({"temperature": {"type": "integer", "minimum": -50, "maximum": 50}}),
                      "Today's temperature in Celsius."),
    "string_list": (_object({"tags": {"type": "array", "items": _short, "maxItems": 5}}), "Tags for a photo."),
    "bounded_list": (_object({"steps": {"type": "array", "items": _short, "minItems": 2, "maxItems": 4}}),
                     "Steps to make tea."),
    "int_matrix": (_object({"rows": {"type": "array", "maxItems": 3, "items": {"type": "array", "items": _int,
                                                                                  "maxItems": 3}}}),
                   "A small matrix of integers."),
    "object_list": (_object({"items": {"type": "array", "maxItems": 3, "items": _object(
        {"name": _short, "price": _num})}}), "A shopping list with prices."),
    "nested_address": (_object({"name": _short, "address": _object({"street": _short, "city": _short,
                                                                    "country": _short})}),
                       "A person and their address."),
    "deep_nesting": (_object({"a": _object({"b": _object({"c": _object({"d": _short})})})}),
                     "A deeply nested config value."),
    "optional_fields": (_object({"name": _short, "nickname": _short, "age": _int}, required=["name"]),
                        "A person, nickname optional."),
    "no_additional": (_object({"x": _int, "y": _int}, additionalProperties=False), "A point in 2D."),
    "string_map": ({"type": "object", "additionalProperties": _int, "maxProperties": 4} | {},
                   "Word counts of a short sentence."),
    "nullable_type": (_object({"name": _short, "middle_name": {"type": ["string", "null"], "maxLength": 20}}),
                      "A name with no middle name."),
    "nullable_anyof": (_object({"parent": {"anyOf": [_short, {"type": "null"}]}}), "A root node's parent."),
    "union_types": (_object({"value": {"anyOf": [_int, _short, _bool]}}), "Any simple value."),
    "oneof_shapes": (_object({"shape": {"oneOf": [
        _object({"kind": {"const": "circle"}, "radius": _num}),
        _object({"kind": {"const": "square"}, "side": _num})]}}), "A circle of radius 2."),
    "allof_merge": ({"allOf": [_object({"id": _int}), _object({"name": _short})]}, "An item with id and name."),
    "defs_refs": ({"$defs": {"money": _object({"amount": _num, "currency": {"enum": ["USD", "EUR"]}})},
                   **_object({"price": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"}})},
                  "A price and its tax."),
    "definitions_refs": ({"definitions": {"point": _object({"x": _num, "y": _num})},
                          **_object({"from": {"$ref": "#/definitions/point"}, "to": {"$ref": "#/definitions/point"}})},
                         "A line segment."),
    "tuple_prefix": (_object({"pair": {"type": "array", "prefixItems": [_short, _int], "items": False}}),
                     "A name and a number as a pair."),
    "github_issue": (_object({"title": _short, "body": {"type": "string", "maxLength": 200},
                              "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3},
                              "assignee": {"type": ["string", "null"], "maxLength": 30}}),
                     "An issue about a crash on start."),
    "calendar_event": (_object({"summary": _short, "start": {"type": "string", "format": "date-time"},
                                "attendees": {"type": "array", "items": {"type": "string", "format": "email"},
                                              "maxItems": 3}}),
                       "A team meeting next Monday."),
    "product_catalog": (_object({"products": {"type": "array", "maxItems": 3, "items": _object({
        "sku": {"type": "string", "pattern": "^[A-Z0-9]{6}$"}, "name": _short,
        "price": {"type": "number", "minimum": 0, "maximum": 10000}, "in_stock": _bool})}}),
                        "Three products of a shop."),
    "package_json": (_object({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,30}$"},
                              "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                              "private": _bool}),
                     "A package.json for a small tool."),
    "docker_service": (_object({"image": _short, "ports": {"type": "array", "items": {
        "type": "integer", "minimum": 1, "maximum": 65535}, "maxItems": 3}, "restart": {
        "enum": ["no", "always", "on-failure"]}}), "A web service definition."),
    "k8s_resources": (_object({"cpu": {"type": "string", "pattern": "^[0-9]+m?$"},
                               "memory": {"type": "string", "pattern": "^[0-9]+(Mi|Gi)$"}}),
                      "Resource limits for a pod."),
    "log_entry": (_object({"level": {"enum": ["debug", "info", "warn", "error"]}, "message": _short,
                           "timestamp": {"type": "string", "format": "date-time"}}), "A log line about a timeout."),
    "http_request": (_object({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]}, "path": {
        "type": "string", "pattern": "^/[a-z0-9/]{0,30}$"}, "headers": {"type": "object", "additionalProperties": _short,
                                                                          "maxProperties": 3}}),
                     "A request to list users."),
    "sentiment": (_object({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
                  "The sentiment of 'I love it'."),
    "entity_extraction": (_object({"entities": {"type": "array", "maxItems": 4, "items": _object({
        "text": _short, "type": {"enum": ["PERSON", "PLACE", "ORG"]}})}}),
                          "Entities in 'Ann works at Acme in Oslo'."),
    "translation": (_object({"source": _short, "target": _short, "language": {
        "type": "string", "pattern": "^[a-z]{2}$"}}), "Translate hello to French."),
    "recipe": (_object({"name": _short, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                        "ingredients": {"type": "array", "maxItems": 4, "items": _object(
                            {"item": _short, "grams": {"type": "integer", "minimum": 0, "maximum": 2000}})}}),
               "A pancake recipe."),
    "weather_report": (_object({"city": _short, "temp_c": {"type": "number", "minimum": -80, "maximum": 60},
                                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}}),
                       "The weather in Oslo."),
    "invoice": (_object({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                         "lines": {"type": "array", "maxItems": 3, "items": _object({"desc": _short, "amount": _num})},
                         "total": _num}),
                "An invoice for two items."),
    "user_settings": (_object({"theme": {"enum": ["light", "dark"]}, "font_size": {
        "type": "integer", "minimum": 8, "maximum": 32}, "notifications": _object({"email": _bool, "sms": _bool})}),
                      "Settings of a user who likes dark mode."),
    "openai_strict_style": ({"type": "object", "properties": {"answer": _str, "steps": {
        "type": "array", "items": _object({"explanation": _str, "output": _str}, additionalProperties=False)}},
        "required": ["answer", "steps"], "additionalProperties": False}, "Solve 2x + 3 = 7 step by step."),
    "unique_tags": (_object({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3,
                                      "uniqueItems": True}}), "Some tags."),
    "tree": ({"type": "object", "properties": {"name": _short, "children": {"type": "array", "items": {"$ref": "#"},
                                                                          "maxItems": 2}},
              "required": ["name", "children"], "additionalProperties": False}, "A family tree of three people."),
    "linked_list": ({"$defs": {"node": _object({"value": _int, "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                  {"type": "null"}]}})},
                     "$ref": "#/$defs/node"}, "A linked list of 1, 2, 3."),
    "json_ast": ({"$defs": {"expr": {"anyOf": [
        _object({"num": _num}),
        _object({"op": {"enum": ["+", "-", "*"]}, "left": {"$ref": "#/$defs/expr"}, "right": {"$ref": "#/$defs/expr"}})]}},
        "$ref": "#/$defs/expr"}, "The expression 1 + 2 as a tree."),
    "comment_thread": ({"$defs": {"comment": _object({"author": _short, "text": _short, "replies": {
        "type": "array", "items": {"$ref": "#/$defs/comment"}, "maxItems": 2}})}, "$ref": "#/$defs/comment"},
                       "A comment with one reply."),
    "any_value": ({}, "Any JSON value."),
    "multiple_of": (_object({"step": {"type": "integer", "multipleOf": 5}}), "A number of minutes, in fives."),
}

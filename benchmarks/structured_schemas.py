"""The JSON schemas of the structured-output benchmarks, each with one valid instance.

`benchmarks/structured.py` asks both real models for an instance of each schema (greedy and
sampled) and validates every output; `benchmarks/grammar_engines.py` times the grammar engines'
masks along the tokens of each ``example``. Together they cover nested objects, arrays with
``minItems`` / ``maxItems``, ``enum``, ``const``, ``pattern``, number ranges (inclusive and
exclusive), ``required``, ``additionalProperties: false``, ``anyOf`` / ``oneOf``, ``$ref`` /
``$defs``, string lengths, ``format`` (date, email, uuid), ``null`` and nullable types.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> Schema:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


# (name, prompt hint, schema, a valid instance)
SCHEMAS: list[tuple[str, str, Schema, Any]] = [
    (
        "person",
        "a person",
        _obj({"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
        {"name": "Ada Lovelace", "age": 36},
    ),
    (
        "city",
        "a city",
        _obj(
            {
                "city": {"type": "string", "minLength": 1, "maxLength": 40},
                "country": {"type": "string"},
                "population": {"type": "integer", "minimum": 1},
                "capital": {"type": "boolean"},
            }
        ),
        {"city": "Paris", "country": "France", "population": 2102650, "capital": True},
    ),
    (
        "colour_enum",
        "a primary colour",
        _obj({"colour": {"enum": ["red", "green", "blue"]}}),
        {"colour": "blue"},
    ),
    (
        "tags_array",
        "a list of 2 to 4 tags for a blog post",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 2,
                    "maxItems": 4,
                }
            }
        ),
        {"tags": ["python", "inference", "json"]},
    ),
    (
        "nested_address",
        "a company with its address",
        _obj(
            {
                "company": {"type": "string"},
                "address": _obj(
                    {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
            }
        ),
        {"company": "Acme", "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}},
    ),
    (
        "zip_pattern",
        "a US zip code",
        _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}}),
        {"zip": "90210-1234"},
    ),
    (
        "phone_pattern",
        "a phone number",
        _obj({"phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{7,12}$"}}),
        {"phone": "+33123456789"},
    ),
    (
        "temperature_range",
        "a weather reading",
        _obj(
            {
                "celsius": {"type": "number", "minimum": -90, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
        {"celsius": 21.5, "humidity": 40},
    ),
    (
        "exclusive_range",
        "a probability and a rating",
        _obj(
            {
                "probability": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            }
        ),
        {"probability": 0.25, "stars": 4},
    ),
    (
        "optional_fields",
        "a book (title required, the rest optional)",
        _obj(
            {
                "title": {"type": "string"},
                "author": {"type": "string"},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
            },
            required=["title"],
        ),
        {"title": "Dune", "year": 1965},
    ),
    (
        "any_of",
        "an identifier that is a number or a string",
        _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 12}]}}),
        {"id": "abc-12"},
    ),
    (
        "one_of_shapes",
        "a geometric shape",
        _obj(
            {
                "shape": {
                    "oneOf": [
                        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                        _obj(
                            {
                                "kind": {"const": "rectangle"},
                                "width": {"type": "number", "minimum": 0},
                                "height": {"type": "number", "minimum": 0},
                            }
                        ),
                    ]
                }
            }
        ),
        {"shape": {"kind": "circle", "radius": 2.5}},
    ),
    (
        "array_of_objects",
        "1 to 3 items of a shopping list",
        _obj(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "name": {"type": "string", "maxLength": 24},
                            "qty": {"type": "integer", "minimum": 1},
                        }
                    ),
                }
            }
        ),
        {"items": [{"name": "milk", "qty": 2}, {"name": "bread", "qty": 1}]},
    ),
    (
        "refs",
        "a family tree of two generations",
        {
            "$defs": {"person": _obj({"name": {"type": "string"}, "born": {"type": "integer"}})},
            **_obj({"parent": {"$ref": "#/$defs/person"}, "child": {"$ref": "#/$defs/person"}}),
        },
        {"parent": {"name": "Ann", "born": 1960}, "child": {"name": "Bob", "born": 1990}},
    ),
    (
        "nullable",
        "a user whose middle name may be null",
        _obj(
            {"first": {"type": "string"}, "middle": {"type": ["string", "null"]}, "last": {"type": "string"}}
        ),
        {"first": "Grace", "middle": None, "last": "Hopper"},
    ),
    (
        "date_format",
        "an event with its date",
        _obj({"event": {"type": "string"}, "date": {"type": "string", "format": "date"}}),
        {"event": "launch", "date": "2024-05-01"},
    ),
    (
        "email_format",
        "a contact with an email address",
        _obj({"name": {"type": "string"}, "email": {"type": "string", "format": "email"}}),
        {"name": "Linus", "email": "linus@example.org"},
    ),
    (
        "uuid_format",
        "an order with a UUID",
        _obj({"order_id": {"type": "string", "format": "uuid"}, "total": {"type": "number", "minimum": 0}}),
        {"order_id": "123e4567-e89b-12d3-a456-426614174000", "total": 9.99},
    ),
    (
        "matrix",
        "a 2x2 matrix of integers",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                }
            }
        ),
        {"rows": [[1, 2], [3, 4]]},
    ),
    (
        "deep_nesting",
        "a product with a manufacturer and its headquarters",
        _obj(
            {
                "product": _obj(
                    {
                        "name": {"type": "string"},
                        "maker": _obj(
                            {
                                "name": {"type": "string"},
                                "hq": _obj({"city": {"type": "string"}, "founded": {"type": "integer"}}),
                            }
                        ),
                    }
                )
            }
        ),
        {"product": {"name": "Phone", "maker": {"name": "Co", "hq": {"city": "Oslo", "founded": 1999}}}},
    ),
    (
        "tool_call",
        "arguments for a weather tool",
        _obj(
            {
                "location": {"type": "string", "description": "city and country"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            required=["location"],
        ),
        {"location": "Paris, France", "unit": "celsius"},
    ),
    (
        "sentiment",
        "the sentiment of 'I love this phone' with a confidence",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            }
        ),
        {"label": "positive", "confidence": 0.9, "keywords": ["love"]},
    ),
    (
        "const_and_bool",
        "a feature flag",
        _obj({"version": {"const": 2}, "enabled": {"type": "boolean"}, "name": {"type": "string"}}),
        {"version": 2, "enabled": False, "name": "dark-mode"},
    ),
    (
        "recipe",
        "a recipe with 2 to 5 ingredients and steps",
        _obj(
            {
                "title": {"type": "string", "maxLength": 40},
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 5,
                    "items": _obj({"item": {"type": "string"}, "grams": {"type": "number", "minimum": 0}}),
                },
                "vegetarian": {"type": "boolean"},
            }
        ),
        {
            "title": "Pancakes",
            "servings": 4,
            "ingredients": [{"item": "flour", "grams": 200}, {"item": "milk", "grams": 300}],
            "vegetarian": True,
        },
    ),
]

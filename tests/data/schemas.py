"""Real-world JSON schemas for structured-output tests: each with a prompt that asks for it."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}

ADDRESS_DEFS = {
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "DE", "FR", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "home": {"$ref": "#/$defs/Address"},
        "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
    },
    "required": ["name", "home", "work"],
    "additionalProperties": False,
}

SCHEMAS = {
    "person": (PERSON, "Describe a fictional person."),
    "address_refs": (ADDRESS_DEFS, "Give a person's home and work address."),
    "product": ({
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "title": {"type": "string", "maxLength": 60},
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "in_stock": {"type": "boolean"},
            "categories": {"type": "array", "items": {"type": "string", "maxLength": 20},
                           "minItems": 1, "maxItems": 3},
        },
        "required": ["sku", "title", "price", "in_stock", "categories"],
        "additionalProperties": False,
    }, "Describe a product in a web shop."),
    "event_dates": ({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 50},
            "date": {"type": "string", "format": "date"},
            "starts": {"type": "string", "format": "date-time"},
            "attendees": {"type": "integer", "minimum": 1, "maximum": 500},
        },
        "required": ["title", "date", "starts", "attendees"],
        "additionalProperties": False,
    }, "Plan a team event."),
    "order_nested": ({
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 30},
                               "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 12},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number", "minimum": 0},
        },
        "required": ["order_id", "customer", "items", "total"],
        "additionalProperties": False,
    }, "Create an example shop order."),
    "sentiment_enum": ({
        "type": "object",
        "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    }, "What is the sentiment of: 'I love this phone'?"),
    "const_version": ({
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    }, "Report status."),
    "anyof_id": ({
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0}]},
                       "label": {"type": "string", "maxLength": 20}},
        "required": ["id", "label"],
        "additionalProperties": False,
    }, "Give an id and a label."),
    "oneof_shapes": ({
        "$defs": {
            "Circle": {"type": "object", "properties": {"kind": {"const": "circle"},
                                                         "radius": {"type": "number", "minimum": 0, "maximum": 100}},
                       "required": ["kind", "radius"], "additionalProperties": False},
            "Square": {"type": "object", "properties": {"kind": {"const": "square"},
                                                         "side": {"type": "integer", "minimum": 1, "maximum": 100}},
                       "required": ["kind", "side"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {"shape": {"oneOf": [{"$ref": "#/$defs/Circle"}, {"$ref": "#/$defs/Square"}]}},
        "required": ["shape"],
        "additionalProperties": False,
    }, "Describe a geometric shape."),
    "optional_props": ({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "subtitle": {"type": "string", "maxLength": 40},
            "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        },
        "required": ["title"],
        "additionalProperties": False,
    }, "Describe a book."),
    "nullable": ({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "middle_name": {"type": ["string", "null"], "maxLength": 20},
            "nickname": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]},
        },
        "required": ["name", "middle_name", "nickname"],
        "additionalProperties": False,
    }, "Describe someone's names."),
    "array_root": ({
        "type": "array",
        "items": {"type": "string", "maxLength": 25},
        "minItems": 2,
        "maxItems": 5,
    }, "List some fruits."),
    "negative_ints": ({
        "type": "object",
        "properties": {"temperature_c": {"type": "integer", "minimum": -40, "maximum": 45},
                       "delta": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10}},
        "required": ["temperature_c", "delta"],
        "additionalProperties": False,
    }, "Report today's weather."),
    "flags": ({
        "type": "object",
        "properties": {"is_admin": {"type": "boolean"}, "is_active": {"type": "boolean"},
                       "verified": {"type": "boolean"}},
        "required": ["is_admin", "is_active", "verified"],
        "additionalProperties": False,
    }, "Describe a user account."),
    "pydantic_style": ({
        "$defs": {
            "Ingredient": {
                "properties": {"name": {"title": "Name", "type": "string", "maxLength": 30},
                               "grams": {"title": "Grams", "type": "integer", "minimum": 1, "maximum": 5000}},
                "required": ["name", "grams"],
                "title": "Ingredient",
                "type": "object",
                "additionalProperties": False,
            }
        },
        "properties": {
            "dish": {"title": "Dish", "type": "string", "maxLength": 40},
            "ingredients": {"items": {"$ref": "#/$defs/Ingredient"}, "title": "Ingredients", "type": "array",
                            "minItems": 1, "maxItems": 4},
        },
        "required": ["dish", "ingredients"],
        "title": "Recipe",
        "type": "object",
        "additionalProperties": False,
    }, "Give me a simple recipe."),
    "string_lengths": ({
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 8},
                       "note": {"type": "string", "minLength": 1, "maxLength": 30}},
        "required": ["code", "note"],
        "additionalProperties": False,
    }, "Make up a discount code and a note."),
    "classification": ({
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["spam", "ham"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    }, "Classify: 'WIN A FREE PRIZE NOW!!!'"),
    "tuple_coordinates": ({
        "type": "object",
        "properties": {
            "place": {"type": "string", "maxLength": 30},
            "coordinates": {"type": "array", "prefixItems": [
                {"type": "number", "minimum": -90, "maximum": 90},
                {"type": "number", "minimum": -180, "maximum": 180},
            ], "items": False},
        },
        "required": ["place", "coordinates"],
        "additionalProperties": False,
    }, "Where is Paris?"),
    "openai_strict": ({
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 80},
            "sources": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
            "followup": {"anyOf": [{"type": "string", "maxLength": 60}, {"type": "null"}]},
        },
        "required": ["answer", "sources", "followup"],
        "additionalProperties": False,
    }, "Why is the sky blue?"),
    "ipv4_and_host": ({
        "type": "object",
        "properties": {"host": {"type": "string", "format": "hostname"},
                       "ip": {"type": "string", "format": "ipv4"},
                       "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
        "required": ["host", "ip", "port"],
        "additionalProperties": False,
    }, "Describe a web server."),
    "allof_objects": ({
        "allOf": [
            {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
             "required": ["id"]},
            {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
        ],
    }, "Make a record with an id and a name."),
    "time_format": ({
        "type": "object",
        "properties": {"opens": {"type": "string", "format": "time"}, "closes": {"type": "string", "format": "time"}},
        "required": ["opens", "closes"],
        "additionalProperties": False,
    }, "When does the shop open and close?"),
}
